#!/usr/bin/env bash
# Creates .venv-jax012 once: the package with its test, flax and bench extras on the newest jax
# that pyproject.toml admits, every other package at the version pinned in constraints.txt.
# `bash scripts/test.sh --jax 0.12` runs the op-level suites and the README's code in it.
set -euo pipefail
cd "$(dirname "$0")/.."
JAX_VERSION=0.12.0.1
VENV=.venv-jax012
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -P -c "
import jax, jaxlib, jax_ops, pytest, xdist, flax, optax, matplotlib
assert jax.__version__ == jaxlib.__version__ == '$JAX_VERSION', jax.__version__" 2>/dev/null; then
  PYTHON="${PYTHON:-python3}"
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    echo "setup_jax012.sh: needs Python >= 3.12, but $PYTHON is $("$PYTHON" -V 2>&1 || echo 'not found');" \
      "set PYTHON to a Python >= 3.12" >&2
    exit 1
  fi
  echo "setup_jax012.sh: creating $VENV with jax==$JAX_VERSION; this takes about a minute..."
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # constraints.txt without its jax and jaxlib pins: every other pin holds on this jax.
  constraints="$(mktemp)"
  trap 'rm -f "$constraints"' EXIT
  grep -v -E '^(jax|jaxlib)==' constraints.txt > "$constraints"
  "$VENV/bin/python" -m pip install -q -e '.[test,flax,bench]' -c "$constraints" \
    "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION"
fi
