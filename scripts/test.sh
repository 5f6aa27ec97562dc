#!/usr/bin/env bash
# The test suite. Off a GPU the Pallas kernels run in interpret mode; GPU-only tests skip.
#   bash scripts/test.sh [pytest args]            every test, on the pinned jax (.venv)
#   bash scripts/test.sh --jax 0.12 [pytest args] the op-level suites and the README on jax 0.12
#                                                 (.venv-jax012, made by setup.sh --jax 0.12)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--jax" ]; then
  bash scripts/setup.sh --jax "${2:-}"  # which takes only 0.12
  shift 2
  python=.venv-jax012/bin/python
  suites=(tests/attention_softmax_dropout_value tests/masked_softmax_dropout tests/qk_scale_softmax
          tests/test_ops.py tests/test_gradient_accuracy.py tests/test_readme.py)
else
  bash scripts/setup.sh
  python=.venv/bin/python
  suites=()
fi
# Off a GPU, XLA compiles each interpreted kernel for the CPU at its lowest optimization level:
# the test shapes are small, so compiling dominates (the numbers checked are the same, but
# for which multiply-adds become FMAs: tests/conftest.py EXACT_COMPILER_OPTIONS; GPU compiles
# are not affected).
if ! command -v nvidia-smi > /dev/null 2>&1; then
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
fi
# -n 2: the interpreters are single-threaded; two workers use both cores of a CI machine.
# --dist worksteal: an idle worker takes queued tests from the other, so the slow tests at the
# end do not leave one core idle. pytest exits 5 when it collects no test: that fails too.
exec "$python" -m pytest -q -n 2 --dist worksteal "${suites[@]}" "$@"
