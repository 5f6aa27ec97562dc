#!/usr/bin/env bash
# Creates a venv (Python >= 3.12) with the package and its test, flax and bench extras, once, at
# the versions pinned in constraints.txt (bench: matplotlib, for the results' charts, which the
# tests draw too):
#   bash scripts/setup.sh             .venv, on the pinned jax
#   bash scripts/setup.sh --jax 0.12  .venv-jax012, on jax and jaxlib $JAX012 (the newest that
#                                     pyproject.toml admits), every other pin the same
set -euo pipefail
cd "$(dirname "$0")/.."
JAX012=0.12.0.1
venv=.venv
# -P: the check must not find the package through the current directory (an install is needed
# for scripts run from elsewhere, such as examples/demo.py).
check="import jax_ops, pytest, xdist, flax, optax, matplotlib"
if [ "${1:-}" = "--jax" ]; then
  if [ "${2:-}" != "0.12" ]; then
    echo "setup.sh: --jax takes 0.12 (the pinned jax is the default), got '${2:-}'" >&2
    exit 2
  fi
  venv=.venv-jax012
  check="$check; import jax, jaxlib; assert jax.__version__ == jaxlib.__version__ == '$JAX012'"
fi
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -P -c "$check" 2>/dev/null; then
  # requires-python in pyproject.toml: say so before pip fails on a dependency.
  PYTHON="${PYTHON:-python3}"
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    echo "setup.sh: needs Python >= 3.12, but $PYTHON is $("$PYTHON" -V 2>&1 || echo 'not found');" \
      "set PYTHON to a Python >= 3.12 (PYTHON=python3.12 bash scripts/setup.sh)" >&2
    exit 1
  fi
  echo "setup.sh: creating $venv and installing the package with its test, flax and bench extras" \
    "(versions pinned by constraints.txt); this takes about a minute..."
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  if [ "$venv" = .venv ]; then
    .venv/bin/python -m pip install -q -e '.[test,flax,bench]' -c constraints.txt
  else
    # constraints.txt without its jax and jaxlib pins: every other pin holds on this jax.
    constraints="$(mktemp)"
    trap 'rm -f "$constraints"' EXIT
    grep -v -E '^(jax|jaxlib)==' constraints.txt > "$constraints"
    "$venv/bin/python" -m pip install -q -e '.[test,flax,bench]' -c "$constraints" \
      "jax==$JAX012" "jaxlib==$JAX012"
  fi
fi
