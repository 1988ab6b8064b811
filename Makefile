# Every target bootstraps what it needs: a fresh machine needs only python3 and make.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo demo-real demo-vllm lock test lint typecheck pytest pytest-single test-fast clean system-deps bench bench-quick soak

# Every dependency at the version in requirements/ci.lock (pyproject.toml declares ranges).
LOCK   := requirements/ci.lock

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c $(LOCK) -e '.[test]'
	touch $(STAMP)

# Re-resolve the locks from pyproject.toml's ranges, keeping every pin that still fits
# (`make lock UPGRADE=1` moves each to the newest in range). CI and the image install from them.
UV_COMPILE = $(BIN)/uv pip compile pyproject.toml --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 $(if $(UPGRADE),--upgrade) --quiet
lock: $(STAMP)
	$(BIN)/pip install --quiet 'uv>=0.13,<1'
	$(UV_COMPILE) --extra test --extra tracing -o requirements/ci.lock
	$(UV_COMPILE) --extra tracing -c requirements/ci.lock -o requirements/runtime.lock

demo: $(STAMP)
	$(BIN)/narwhal-serve --demo

# The router in front of one prefill and one decode llama-server (docs/engines.md).
demo-real: $(STAMP)
	VENV=$(VENV) scripts/demo-real.sh

# The router in front of one prefill and one decode vLLM (CPU build) over NIXL (docs/engines.md).
demo-vllm: $(STAMP)
	VENV=$(VENV) scripts/demo-vllm.sh

lint: $(STAMP)
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts

typecheck: $(STAMP)
	$(BIN)/mypy

# Debian packages the tests use for real: etcd-server (the etcd lease backend), dnsmasq-base (a
# DNS server for discovery), chromium (the dashboard, in a headless browser) and slowhttptest
# (the hostile suite's slow clients). Installed only when missing.
system-deps:
	@missing=""; \
	command -v etcd >/dev/null 2>&1 || missing="$$missing etcd-server"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v dnsmasq >/dev/null 2>&1 || missing="$$missing dnsmasq-base"; \
	command -v slowhttptest >/dev/null 2>&1 || missing="$$missing slowhttptest"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing (Debian)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# The suite in one process per idle CPU (pytest-xdist, a module per process at a time; two on
# an idle 2-core machine, one beside a neighbour that keeps a core busy, measured at each part's
# start: scripts/test_processes.py), then the real vLLM module alone: an idle vLLM with the
# NixlConnector keeps cores busy and starves whatever runs beside it. The slowest tests are
# listed at the end of each, so CI's log shows where the suite's time goes (docs/testing.md).
XDIST = -n $$($(BIN)/python scripts/test_processes.py) --dist loadfile
pytest: $(STAMP) system-deps
	$(BIN)/pytest -q $(XDIST) --durations=25 -m 'not vllm'
	$(BIN)/pytest -q --durations=5 -m vllm

# The data-plane, failure, migration, embeddings and OpenAI-surface scenarios again with one
# process (the default is a control process and one worker per CPU): both modes stay covered
# (docs/testing.md, "Workers in the tests").
pytest-single: $(STAMP) system-deps
	NARWHAL_TEST_WORKERS=1 $(BIN)/pytest -q $(XDIST) -m 'not llama' tests/e2e/test_dataplane_*.py tests/e2e/test_failures_*.py tests/e2e/test_migration.py tests/e2e/test_embeddings.py tests/e2e/test_openai_surface.py

test: lint typecheck pytest pytest-single

# Local loop: skips the slow end-to-end scenarios and the real engines (CI runs everything).
test-fast: $(STAMP) system-deps
	$(BIN)/pytest -q $(XDIST) -m 'not slow and not llama and not vllm'

# Benchmarks (docs/benchmarks.md): full run (~50 min on 2 cores, llama, floor_ab, router_bound, cache and flow suites included) and a quick smoke (< 1 min).
bench: $(STAMP)
	$(BIN)/python -m bench --mode full --report docs/benchmarks.md --results bench-results

bench-quick: $(STAMP)
	$(BIN)/python -m bench --mode quick --report bench-results/quick.md --results bench-results

# Chaos soak (docs/soak.md): Narwhal's active/standby pair, then each peer,
# 3 minutes each under a seeded fault schedule (SEED=n to change it); ~11 min on 2 cores.
SEED ?= 99
soak: $(STAMP)
	$(BIN)/python -m bench --mode soak --seed $(SEED) --report bench-results/soak.md --results bench-results

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
