#!/usr/bin/env bash
# Kernel B's backward at one workload under XLA flags that change how XLA compiles a Triton
# kernel (PTX to SASS), beside the plain Triton row kernel (benchmarks/b_triton_row.py).
# Also lists the ptxas- and Triton-related flags the installed CUDA plugin knows.
#
# Usage (on the GPU machine, from the repository root):
#   OUT=dir bash benchmarks/b_xla_flags.sh ["4,4,4096"] [warps of the Triton kernel]
set -uo pipefail
OUT=${OUT:-.}
ONLY=${1:-4,4,4096}
WARPS=${2:-16}
export PYTHONPATH=${PYTHONPATH:-.}
PLUGIN=$(python3 -c "import jax_plugins.xla_cuda13 as p, os; print(os.path.dirname(p.__file__))" 2>/dev/null)
echo "plugin: $PLUGIN"
for so in "$PLUGIN"/*.so; do
  strings "$so" | grep -E "^xla_gpu_[a-z_]*(ptx|asm|triton|nvptx|llvm)[a-z_]*$" | sort -u
done > "$OUT/b_xla_flags_known.txt"
wc -l "$OUT/b_xla_flags_known.txt"; head -60 "$OUT/b_xla_flags_known.txt"
run() {
  local label=$1; shift
  XLA_FLAGS="$*" python3 -m benchmarks.b_triton_row --only "$ONLY" --warps "$WARPS" \
    --calls 30 --out "$OUT" > "$OUT/b_xla_flags_$label.log" 2>&1
  echo "== $label [$*]: rc $?"
  grep -E "^ +[0-9]+, [0-9]+, [0-9]+" "$OUT/b_xla_flags_$label.log" | head -2
}
run default ""
run nvptxcompiler "--xla_gpu_enable_libnvptxcompiler=true"
run no_nvptxcompiler "--xla_gpu_enable_libnvptxcompiler=false"
run no_asm_opt "--xla_gpu_disable_gpuasm_optimizations=true"
run no_command_buffer "--xla_gpu_enable_command_buffer="
