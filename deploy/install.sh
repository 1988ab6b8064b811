#!/bin/sh
# Install Narwhal (and its pinned dependencies) into the Python environment of $PYTHON.
#
#   PYTHON=/opt/narwhal/bin/python deploy/install.sh SOURCE
#
# SOURCE is a source tree holding pyproject.toml, README.md and src/ (what deploy/Dockerfile
# copies), or a built wheel. The container image runs exactly this script, and so does
# tests/deploy/test_install.py in a fresh virtualenv: what the test checks is what ships.
set -eu
PYTHON="${PYTHON:-python3}"
if [ "$#" -ne 1 ]; then
  echo "usage: PYTHON=/path/to/venv/bin/python $0 SOURCE_DIR_OR_WHEEL" >&2
  exit 2
fi
exec "$PYTHON" -m pip install --no-cache-dir --no-input --disable-pip-version-check "$1"
