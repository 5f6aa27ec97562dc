"""What a copy of each workload's minimum bytes takes, at that size: the fraction of the floor
that a kernel moving exactly those bytes reaches, beside the library's kernel, on a GPU.

The floor of a workload is its minimum bytes over the copy bandwidth of a large copy (2 GiB).
A small workload cannot reach it: a kernel's launch, its first round trip to memory and its
tail cost a few microseconds whatever it computes. This times, per workload, a copy of the
floor's bytes (half read, half written; fp32, an XLA ``x * 2`` and a Pallas copy kernel, the
faster one) with input sets rotated so that L2 is cold, and the kernel entry point the same
way.

Usage::

    PYTHONPATH=. python3 -m benchmarks.size_ceiling [--op masked_softmax_dropout]
        [--calls 30] [--out DIR]

Writes ``<out>/size_ceiling_<op>.json`` and prints per workload: the floor, the copy at that
size (time, floor / time), the kernel (time, floor / time) and the kernel over the copy; and
the geomeans.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

from benchmarks import run
from benchmarks.timing import copy_ceiling, copy_fns, device_times_us, no_gpu

_BLOCK = 4096   # fp32 elements per program of the Pallas copy


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--op", default="masked_softmax_dropout", choices=sorted(run.PROBLEMS))
  parser.add_argument("--calls", type=int, default=30)
  parser.add_argument("--out", default=".")
  args = parser.parse_args(argv)
  if no_gpu("timing copies at the workloads' sizes", "nothing timed"):
    return 2
  problem = run.problem_of(args.op)
  with open(os.path.join(run.HERE, "workloads.json")) as f:
    spec = json.load(f)[problem.name + "_backward"]
  workloads, constants = spec["workloads"], spec["constants"]
  ceiling = copy_ceiling()["TBps"]
  rows = []
  for index, w in enumerate(workloads):
    floor_bytes = problem.floor_bytes(w, constants)
    floor_us = floor_bytes / (ceiling * 1e6)
    n = max(_BLOCK, -(-floor_bytes // 8 // _BLOCK) * _BLOCK)
    sets = run.input_sets(lambda key: (jax.random.normal(key, (n,), jnp.float32),), index)
    copies = list(copy_fns(n, block=_BLOCK, num_warps=4).values())
    copy_us = min(t["median_us"] for t in device_times_us(copies, sets, calls=args.calls))
    ksets = run.input_sets(lambda key: problem.make_inputs(w, constants, key), index)
    kernel = lambda *a: problem.kernel(a, w, constants)
    kernel_us = device_times_us([kernel], ksets, calls=args.calls)[0]["median_us"]
    row = {"workload": problem.label(w), "floor_us": floor_us, "copy_us": copy_us,
           "kernel_us": kernel_us, "copy_frac": floor_us / copy_us,
           "kernel_frac": floor_us / kernel_us}
    rows.append(row)
    print(f"{row['workload']:>22s}  floor {floor_us:8.1f} us  copy {copy_us:8.1f} us "
          f"({row['copy_frac']:.0%})  kernel {kernel_us:8.1f} us ({row['kernel_frac']:.0%})  "
          f"kernel/copy {kernel_us / copy_us:.2f}", flush=True)
  geo = {k: run.geomean([r[k] for r in rows]) for k in ("copy_frac", "kernel_frac")}
  print(f"geomean: copy at size {geo['copy_frac']:.1%} of the floor, kernel "
        f"{geo['kernel_frac']:.1%}; ceiling {ceiling:.3f} TB/s")
  with open(os.path.join(args.out, f"size_ceiling_{args.op}.json"), "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "commit": os.environ.get("BENCH_COMMIT"), "ceiling_tbps": ceiling,
               "rows": rows, "geomean": geo}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
