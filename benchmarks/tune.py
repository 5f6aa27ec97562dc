"""Tunes the masked-softmax-dropout kernel's launch config on this GPU.

Usage (on a GPU)::

    PYTHONPATH=. python3 -m benchmarks.tune [--out pallas_kernels/tuned/masked_softmax_dropout.json]

For every workload of ``benchmarks/workloads.json`` it times a set of
candidate configs (elements per program, warps, split columns) in one profiler
trace, then picks for each row-length class (``length_class(Sk)``: the padded
length, and whether rows are ragged) the
candidate with the best geomean over that class's workloads (each time divided
by the workload's best). The kernel uses the table when the device matches.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import jax

from benchmarks import run as bench
from benchmarks.timing import compile_all, device_times_us
from pallas_kernels import _tuning
from pallas_kernels import masked_softmax_dropout as msd

# (elements per program, warps): 4 to 32 elements per thread and array.
CANDIDATES = [(512, 1), (512, 2), (512, 4), (1024, 1), (1024, 2), (1024, 4), (1024, 8),
              (2048, 2), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16), (8192, 8),
              (8192, 16)]


def write_table(configs: dict, out: str, *, merge: bool = False) -> dict:
  """Writes a tuned table for this device; ``merge`` keeps the classes of the table
  already at ``out`` (same device kind) that ``configs`` does not replace."""
  device_kind = jax.devices()[0].device_kind
  table = {}
  if merge and os.path.exists(out):
    with open(out) as f:
      old = json.load(f)
    if old.get("device_kind") == device_kind:
      table.update(old["configs"])
  for key, entry in configs.items():  # per class, new fields replace old ones
    table[key] = {**table.get(key, {}), **entry} if merge else entry
  result = {"device_kind": device_kind,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "jax": jax.__version__, "configs": dict(sorted(table.items()))}
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  return result


def best_by_geomean(ratios: list[dict]):
  """The candidate with the best geomean of time / best time over the workloads, and it."""
  common = set.intersection(*(set(r) for r in ratios))
  if not common:  # every candidate failed on some workload of the class
    print("no candidate ran on every workload of a class; its entry is left as it was")
    return None, None
  score = {c: math.exp(sum(math.log(r[c]) for r in ratios) / len(ratios)) for c in common}
  best = min(score, key=score.get)
  return best, round(score[best], 4)


def _write_table(by_class: dict[str, list[dict]], out: str) -> dict:
  """Per length class, the candidate with the best geomean of time / best time."""
  table = {}
  for key, ratios in sorted(by_class.items()):
    best, score = best_by_geomean(ratios)
    if best is not None:
      target, warps, split = best
      table[key] = {"target": target, "num_warps": warps, "split": split,
                    "geomean_vs_best": score}
  # Merged into the table already there: a run cut short keeps the classes it did not reach.
  return write_table(table, out, merge=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=_tuning.table_path("masked_softmax_dropout"))
  parser.add_argument("--calls", type=int, default=10)
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    print("tuning needs a CUDA GPU", file=sys.stderr)
    return 2
  with open(os.path.join(bench.HERE, "workloads.json")) as f:
    workloads = json.load(f)["masked_softmax_dropout_backward"]["workloads"]
  by_class: dict[str, list[dict]] = {}
  for index, w in enumerate(workloads):
    sq = sk = w["seq_len"]
    sets = [bench.PROBLEM_B.make_inputs(w, {}, jax.random.key(7000 + 100 * index + i))
            for i in range(2)]
    set_bytes = sum(x.size * x.dtype.itemsize for x in sets[0])
    n_sets = int(min(32, max(2, math.ceil(bench._ROTATE_BYTES / set_bytes))))
    sets += [bench.PROBLEM_B.make_inputs(w, {}, jax.random.key(7000 + 100 * index + i))
             for i in range(2, n_sets)]
    cands = {}
    for target, warps in CANDIDATES:
      for split in (True, False):  # identical configs when Sk is a power of two
        config = msd.config_for(sq, sk, target=target, num_warps=warps, split=split)
        width = sum(w for _, w in msd.column_chunks(sk, split))
        if config.block_rows * width > 64 * 32 * warps:
          continue  # over 64 elements per thread and array: spills
        cands.setdefault(config, []).append((target, warps, split))
    configs = list(cands)
    compiled = compile_all([lambda g, p, m, k, c=c: msd.masked_softmax_dropout_backward(
        g, p, m, k, w["p_dropout"], config=c) for c in configs], sets[0])
    configs = [c for c, exe in zip(configs, compiled) if exe is not None]
    fns = [exe for exe in compiled if exe is not None]
    times = [t["median_us"] for t in device_times_us(fns, sets, calls=args.calls, warmup=2)]
    best = min(times)
    floor = bench._b_floor(w, {}) / (4.27e6)
    print(f"{bench.PROBLEM_B.label(w):>22}  best {best:8.1f} us (~{floor / best:.0%} of a 4.27 TB/s "
          "floor)  " + "  ".join(f"{c.block_rows}r/{c.num_warps}w/{'s' if c.split else 'p'}:{t:.1f}"
                                for c, t in zip(configs, times)), flush=True)
    ratio = {}
    for config, t in zip(configs, times):
      for cand in cands[config]:
        ratio[cand] = t / best
    by_class.setdefault(msd.length_class(sk), []).append(ratio)
    result = _write_table(by_class, args.out)  # after every workload: a cut run keeps its part
  print(json.dumps(result, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
