# Every target bootstraps what it needs: a fresh machine needs only python3 and make.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest test-fast clean system-deps

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/narwhal-serve --demo

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: $(STAMP)
	$(BIN)/mypy

# A real etcd server for the etcd lease backend's tests (Debian's etcd-server).
system-deps:
	@command -v etcd >/dev/null 2>&1 || { \
	  echo "installing etcd-server (Debian)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server; }

pytest: $(STAMP) system-deps
	$(BIN)/pytest -q

test: lint typecheck pytest

# Local loop: skips the slow end-to-end scenarios (CI runs everything).
test-fast: $(STAMP) system-deps
	$(BIN)/pytest -q -m 'not slow'

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
