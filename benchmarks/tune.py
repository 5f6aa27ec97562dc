"""Tunes the masked-softmax-dropout kernel's launch config on this GPU.

Usage (on a GPU)::

    PYTHONPATH=. python3 -m benchmarks.tune [--out PATH]

For every workload of ``pallas_kernels/workloads.json`` it times a set of
candidate configs (elements per program, warps, split columns) in one profiler
trace, then picks for each row-length class (``length_class(Sk)``: the padded
length, and whether rows are ragged) the
candidate with the best geomean over that class's workloads (each time divided
by the workload's best). The kernel uses the table when the device matches.

The table (default ``pallas_kernels/tuned/<device>/masked_softmax_dropout.json``, the
folder of ``jax.devices()[0].device_kind``) holds configs only: per class a
``TableEntry``'s JSON object (``target``, ``num_warps``, ``split``), as
``masked_softmax_dropout.default_config`` reads it. The notes (each entry's
``geomean_vs_best``, the times) are printed.

``write_table`` is shared with ``benchmarks/tune_attention.py``.
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
from pallas_kernels._timing import compile_all, device_times_us, no_gpu
from pallas_kernels import _tuning
from pallas_kernels import masked_softmax_dropout as msd
from pallas_kernels.masked_softmax_dropout.config import KERNEL
from pallas_kernels.workloads import spec

# TableEntry fields (each is timed with split=True and split=False): 4 to 32 elements per
# thread and array.
CANDIDATES = [
    dict(target=512, num_warps=1), dict(target=512, num_warps=2), dict(target=512, num_warps=4),
    dict(target=1024, num_warps=1), dict(target=1024, num_warps=2),
    dict(target=1024, num_warps=4), dict(target=1024, num_warps=8),
    dict(target=2048, num_warps=2), dict(target=2048, num_warps=4),
    dict(target=2048, num_warps=8),
    dict(target=4096, num_warps=4), dict(target=4096, num_warps=8),
    dict(target=4096, num_warps=16),
    dict(target=8192, num_warps=8), dict(target=8192, num_warps=16),
]


def entry_json(entry: dict) -> dict:
  """A class's entry as the kernel reads it (``TableEntry``'s JSON); ``ValueError`` (or
  ``KeyError``/``TypeError``) if it is not one."""
  return msd.TableEntry.from_json(entry).to_json()


def _class_order(key: str):
  """Classes by length, the aligned one before the ragged one."""
  length, _, rest = key.partition("-")
  return (int(length), rest) if length.isdigit() else (math.inf, key)


def _dumps(value, depth: int = 0) -> str:
  """JSON with one level per line down to a class's entry; the objects inside an entry
  (a pass's config) on one line each."""
  if not isinstance(value, dict) or not value or depth >= 3:
    return json.dumps(value)
  pad = " " * (depth + 1)
  items = [f"{pad}{json.dumps(k)}: {_dumps(v, depth + 1)}" for k, v in value.items()]
  return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"


def read_table(path: str, device_kind: str) -> dict:
  """The configs of the table at ``path`` if it was measured on ``device_kind``, else ``{}``."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    old = json.load(f)
  return dict(old.get("configs", {})) if old.get("device_kind") == device_kind else {}


def compute_capability(device_kind: str) -> str | None:
  """The compute capability of this process's device of ``device_kind`` (a table records it:
  devices without tables of their own take those of their architecture)."""
  caps = {getattr(d, "compute_capability", None) for d in jax.devices()
          if d.device_kind == device_kind}
  return str(caps.pop()) if len(caps) == 1 and None not in caps else None


def _old_capability(path: str) -> str | None:
  try:
    with open(path) as f:
      return json.load(f).get("compute_capability")
  except (OSError, ValueError):
    return None


def write_table(configs: dict, out: str, *, entry_json=entry_json, merge: bool = False,
                per_field: bool = False, device_kind: str | None = None) -> dict:
  """Writes a tuned table ``{class: entry}`` for ``device_kind`` (default: this process's
  first device's) to ``out``; returns what it wrote.

  ``entry_json(entry)`` gives an entry as the kernel reads it (its named fields; it raises
  if the entry is not valid). ``merge`` keeps the classes of the table already at ``out``
  (same device kind) that ``configs`` does not replace; with ``per_field`` a class in both
  keeps the old entry's fields (passes) that the new one lacks. An entry that is not valid
  (an old table's, say) is left out, with a message.
  """
  device_kind = device_kind or jax.devices()[0].device_kind
  old = read_table(out, device_kind) if merge else {}
  table = {}
  for key in set(old) | set(configs):
    tries = []
    if key in configs and key in old and per_field and isinstance(old[key], dict):
      tries.append({**old[key], **configs[key]})
    tries.append(configs[key] if key in configs else old[key])
    for entry in tries:
      try:
        table[key] = entry_json(entry)
        break
      except (KeyError, TypeError, ValueError) as e:
        error = e
    else:
      print(f"table {out}: class {key} left out, not a valid entry ({type(error).__name__}: "
            f"{error}): {json.dumps(tries[-1])}", flush=True)
  result = {"device_kind": device_kind,
            "compute_capability": compute_capability(device_kind) or _old_capability(out),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "jax": jax.__version__,
            "configs": {k: table[k] for k in sorted(table, key=_class_order)}}
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    f.write(_dumps(result) + "\n")
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


def select(by_class: dict[str, list[dict]]) -> tuple[dict, dict]:
  """Per length class, the candidate (a ``TableEntry``) with the best geomean of time /
  best time: ``({class: entry JSON}, {class: geomean_vs_best})``."""
  table, notes = {}, {}
  for key, ratios in sorted(by_class.items()):
    best, score = best_by_geomean(ratios)
    if best is not None:
      table[key], notes[key] = best.to_json(), score
  return table, notes


def _write_table(by_class: dict[str, list[dict]], out: str, device_kind=None) -> dict:
  """Writes the selected entries (configs only) and prints their notes."""
  table, notes = select(by_class)
  print("  selected: " + "  ".join(
      f"{k}: {e['target']}/{e['num_warps']}w/{'s' if e['split'] else 'p'} "
      f"(geomean_vs_best {notes[k]})" for k, e in table.items()), flush=True)
  # Merged into the table already there: a run cut short keeps the classes it did not reach.
  return write_table(table, out, merge=True, device_kind=device_kind)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None,
                      help="default: pallas_kernels/tuned/<this device>/masked_softmax_dropout.json")
  parser.add_argument("--calls", type=int, default=10)
  args = parser.parse_args(argv)
  if no_gpu("tuning"):
    return 2
  device_kind = jax.devices()[0].device_kind
  out = args.out or _tuning.table_path(KERNEL, device_kind)
  workloads = spec()["masked_softmax_dropout_backward"]["workloads"]
  by_class: dict[str, list[dict]] = {}
  result = None
  for index, w in enumerate(workloads):
    sq = sk = w["seq_len"]
    sets = [bench.PROBLEM_MASKED.make_inputs(w, {}, jax.random.key(7000 + 100 * index + i))
            for i in range(2)]
    set_bytes = sum(x.size * x.dtype.itemsize for x in sets[0])
    n_sets = int(min(32, max(2, math.ceil(bench._ROTATE_BYTES / set_bytes))))
    sets += [bench.PROBLEM_MASKED.make_inputs(w, {}, jax.random.key(7000 + 100 * index + i))
             for i in range(2, n_sets)]
    cands = {}
    for cand in CANDIDATES:
      for split in (True, False):  # identical configs when Sk is a power of two
        entry = msd.TableEntry(**cand, split=split)
        config = entry.config(sq, sk)
        width = sum(w for _, w in msd.column_chunks(sk, split))
        if config.block_rows * width > 64 * 32 * entry.num_warps:
          continue  # over 64 elements per thread and array: spills
        cands.setdefault(config, []).append(entry)
    configs = list(cands)
    compiled = compile_all([lambda g, p, m, k, c=c: msd.masked_softmax_dropout_backward(
        g, p, m, k, w["p_dropout"], config=c) for c in configs], sets[0])
    configs = [c for c, exe in zip(configs, compiled) if exe is not None]
    fns = [exe for exe in compiled if exe is not None]
    times = [t["median_us"] for t in device_times_us(fns, sets, calls=args.calls, warmup=2)]
    best = min(times)
    floor = bench._masked_floor(w, {}) / (4.27e6)
    print(f"{bench.PROBLEM_MASKED.label(w):>22}  best {best:8.1f} us (~{floor / best:.0%} of a 4.27 TB/s "
          "floor)  " + "  ".join(f"{c.block_rows}r/{c.num_warps}w/{'s' if c.split else 'p'}:{t:.1f}"
                                for c, t in zip(configs, times)), flush=True)
    ratio = {}
    for config, t in zip(configs, times):
      for cand in cands[config]:
        ratio[cand] = t / best
    by_class.setdefault(msd.length_class(sk), []).append(ratio)
    # After every workload: a cut run keeps its part.
    result = _write_table(by_class, out, device_kind)
  print(json.dumps(result, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
