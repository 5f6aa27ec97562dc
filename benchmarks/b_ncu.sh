#!/usr/bin/env bash
# Kernel B's backward under Nsight Compute: the library's Pallas kernel (compiled by XLA's
# Triton pipeline) beside the plain Triton row kernel of benchmarks/b_triton_row.py, on one
# workload. Writes each kernel's launch statistics, occupancy, memory throughput and SASS
# so the two compilations can be compared instruction by instruction.
#
# Usage (on the GPU machine, from the repository root):
#   OUT=dir bash benchmarks/b_ncu.sh ["4,4,4096"] [warps of the Triton kernel]
set -uo pipefail
OUT=${OUT:-.}
ONLY=${1:-4,4,4096}
WARPS=${2:-16}
export PYTHONPATH=${PYTHONPATH:-.}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"; "$NCU" --version | tail -1
# The names of the kernels the run launches (the Pallas kernel's is given by XLA).
"$NCU" --clock-control none --metrics gpu__time_duration.sum --launch-count 40 \
  python3 -m benchmarks.b_triton_row --only "$ONLY" --warps "$WARPS" --calls 4 --max-sets 2 \
  --out "$OUT" 2>&1 | grep -E "Context [0-9]+, Stream" | sort | uniq -c | head -20
SECTIONS="--section LaunchStats --section Occupancy --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats"
for name in masked_softmax _row_kernel; do
  "$NCU" --clock-control none -k "regex:$name" --launch-skip 3 --launch-count 1 $SECTIONS \
    --import-source no -f -o "$OUT/b_ncu_$name" \
    python3 -m benchmarks.b_triton_row --only "$ONLY" --warps "$WARPS" --calls 4 --max-sets 2 \
    --out "$OUT" > "$OUT/b_ncu_${name}_run.log" 2>&1
  echo "== $name: rc $?"; tail -3 "$OUT/b_ncu_${name}_run.log"
  "$NCU" -i "$OUT/b_ncu_$name.ncu-rep" --page details > "$OUT/b_ncu_${name}_details.txt" 2>&1
  "$NCU" -i "$OUT/b_ncu_$name.ncu-rep" --page source --print-source sass \
    > "$OUT/b_ncu_${name}_sass.txt" 2>&1
  wc -l "$OUT/b_ncu_${name}_sass.txt"
done
for name in masked_softmax _row_kernel; do
  echo "== $name"
  grep -E "Duration|Memory Throughput|DRAM Throughput|Registers Per Thread|Shared Memory|Block Limit|Achieved Occupancy|Theoretical Occupancy|Block Size|Grid Size|Waves|Eligible Warps|No Eligible|Warp Cycles Per Issued" \
    "$OUT/b_ncu_${name}_details.txt" | head -40
done
