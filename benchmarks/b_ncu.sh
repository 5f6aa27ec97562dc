#!/usr/bin/env bash
# Kernel B's backward under Nsight Compute: the library's Pallas kernel (compiled by XLA's
# Triton pipeline; its default config and the public row kernel's design) beside the plain
# Triton row kernel of benchmarks/b_triton_row.py, on one workload
# (benchmarks/b_ncu_driver.py launches them). Writes each kernel's launch statistics,
# occupancy, memory throughput and SASS, to compare the compilations.
#
# Usage (on the GPU machine, from the repository root):
#   OUT=dir bash benchmarks/b_ncu.sh ["4,4,4096,0.1" [driver options, e.g. --set smem0]]
#   (the report files are named after the workload)
set -uo pipefail
OUT=${OUT:-.}
ONLY=${1:-4,4,4096,0.1}
shift || true
TAG=b_ncu_${ONLY//[,.]/_}
export PYTHONPATH=${PYTHONPATH:-.}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"; "$NCU" --version | tail -1
"$NCU" --clock-control none --profile-from-start off --section LaunchStats --section Occupancy \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
  --section WarpStateStats --import-source no -f -o "$OUT/$TAG" \
  python3 -m benchmarks.b_ncu_driver "$ONLY" --calls 1 "$@" > "$OUT/${TAG}_run.log" 2>&1
echo "rc $?"; tail -3 "$OUT/${TAG}_run.log"
"$NCU" -i "$OUT/$TAG.ncu-rep" --page details > "$OUT/${TAG}_details.txt" 2>&1
"$NCU" -i "$OUT/$TAG.ncu-rep" --page source --print-source sass > "$OUT/${TAG}_sass.txt" 2>&1
wc -l "$OUT/${TAG}_sass.txt"
grep -E "^  [A-Za-z_].*Context|Duration|DRAM Throughput|Registers Per Thread|Shared Memory Configuration Size|Dynamic Shared Memory Per Block|Static Shared Memory Per Block|Block Limit (Registers|Shared Mem|Warps)|Achieved Occupancy|Theoretical Occupancy|Block Size|Grid Size|Eligible Warps Per Scheduler|No Eligible|Warp Cycles Per Issued" \
  "$OUT/${TAG}_details.txt" | head -240
