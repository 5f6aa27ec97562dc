#!/usr/bin/env bash
# The main job: a jit-compiled training step of a tiny attention model on the three ops.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
