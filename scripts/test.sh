#!/usr/bin/env bash
# The test suite. Off a GPU the Pallas kernels run in interpret mode; GPU-only tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Off a GPU, XLA compiles each interpreted kernel for the CPU at its lowest optimization level:
# the test shapes are small, so compiling dominates (the numbers checked are the same; GPU
# compiles are not affected).
if ! command -v nvidia-smi > /dev/null 2>&1; then
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
fi
# -n 2: the interpreters are single-threaded; two workers use both cores of a CI machine.
# --dist worksteal: an idle worker takes queued tests from the other, so the slow tests at the
# end do not leave one core idle.
exec .venv/bin/python -m pytest -q -n 2 --dist worksteal "$@"
