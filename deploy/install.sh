#!/bin/sh
# Install Narwhal with its `tracing` extra into the Python environment of $PYTHON, every
# dependency at the version locked in requirements/runtime.lock.
#
#   PYTHON=/opt/narwhal/bin/python deploy/install.sh SOURCE
#
# SOURCE is a source tree holding pyproject.toml, README.md, LICENSE, requirements/runtime.lock
# and src/ (what deploy/Dockerfile copies), or a built wheel (then LOCK=path/to/runtime.lock
# pins its dependencies the same way). The container image runs exactly this script, and so does
# tests/deploy/test_install.py in a fresh virtualenv: what the test checks is what ships.
set -eu
PYTHON="${PYTHON:-python3}"
if [ "$#" -ne 1 ]; then
  echo "usage: PYTHON=/path/to/venv/bin/python $0 SOURCE_DIR_OR_WHEEL" >&2
  exit 2
fi
if [ -d "$1" ]; then
  LOCK="${LOCK:-$1/requirements/runtime.lock}"
fi
exec "$PYTHON" -m pip install --no-cache-dir --no-input --disable-pip-version-check \
  ${LOCK:+-c "$LOCK"} "$1[tracing]"
