#!/usr/bin/env bash
# The test suite. Off a GPU the Pallas kernels run in interpret mode; GPU-only tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# -n 2: the interpreters are single-threaded; two workers use both cores of a CI machine.
exec .venv/bin/python -m pytest -q -n 2 "$@"
