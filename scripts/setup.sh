#!/usr/bin/env bash
# Creates .venv (Python >= 3.12) with the package and its test and flax extras, once.
set -euo pipefail
cd "$(dirname "$0")/.."
# -P: the check must not find the package through the current directory (an install is needed
# for scripts run from elsewhere, such as examples/demo.py).
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -P -c "import jax_ops, pytest, flax, optax" 2>/dev/null; then
  python3 -c 'import sys; assert sys.version_info >= (3, 12), f"need Python >= 3.12, got {sys.version}"'
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test,flax]'
fi
