#!/usr/bin/env bash
# Creates .venv (Python >= 3.12) with the package and its test, flax and bench extras, once, at
# the versions pinned in constraints.txt (bench: matplotlib, for the results' charts, which the
# tests draw too).
set -euo pipefail
cd "$(dirname "$0")/.."
# -P: the check must not find the package through the current directory (an install is needed
# for scripts run from elsewhere, such as examples/demo.py).
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -P -c "import jax_ops, pytest, xdist, flax, optax, matplotlib" 2>/dev/null; then
  # requires-python in pyproject.toml: say so before pip fails on a dependency.
  PYTHON="${PYTHON:-python3}"
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    echo "setup.sh: needs Python >= 3.12, but $PYTHON is $("$PYTHON" -V 2>&1 || echo 'not found');" \
      "set PYTHON to a Python >= 3.12 (PYTHON=python3.12 bash scripts/setup.sh)" >&2
    exit 1
  fi
  echo "setup.sh: creating .venv and installing the package with its test, flax and bench extras" \
    "(versions pinned by constraints.txt); this takes about a minute..."
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test,flax,bench]' -c constraints.txt
fi
