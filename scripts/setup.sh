#!/usr/bin/env bash
# Creates .venv (Python >= 3.12) with the package and its test, flax and bench extras, once, at
# the versions pinned in constraints.txt (bench: matplotlib, for the results' charts, which the
# tests draw too).
set -euo pipefail
cd "$(dirname "$0")/.."
# -P: the check must not find the package through the current directory (an install is needed
# for scripts run from elsewhere, such as examples/demo.py).
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -P -c "import jax_ops, pytest, xdist, flax, optax, matplotlib" 2>/dev/null; then
  python3 -c 'import sys; assert sys.version_info >= (3, 12), f"need Python >= 3.12, got {sys.version}"'
  echo "setup.sh: creating .venv and installing the package with its test, flax and bench extras" \
    "(versions pinned by constraints.txt); this takes about a minute..."
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test,flax,bench]' -c constraints.txt
fi
