"""What the variant scripts (``a_mosaic_variants``, ``c_mosaic_variants``, ``c_dl_gemm``)
share: their workloads and copy ceiling, checking and timing a workload's variants, and the
table they print (per workload, each variant's fraction of the floor and time; a variant
that missed the tolerance on a workload is marked ``FAIL`` there and left out of its
geomean)."""

from __future__ import annotations

import json
import math
import os
import traceback

from benchmarks import run
from benchmarks.timing import copy_ceiling, device_times_us


def setup(problem: str, workloads: str | None):
  """``(spec, indices, ceiling)``: ``problem``'s entry of ``workloads.json``, the workload
  indices named by ``workloads`` (``"0,3"``; ``None``: all) and this GPU's copy ceiling
  (printed)."""
  with open(os.path.join(run.HERE, "workloads.json")) as f:
    spec = json.load(f)[problem]
  ceiling = copy_ceiling()
  print(f"copy ceiling {ceiling['TBps']:.3f} TB/s", flush=True)
  idx = (range(len(spec["workloads"])) if workloads is None
         else [int(i) for i in workloads.split(",")])
  return spec, idx, ceiling


def check_and_time(label, w, floor_us, fns, sets, refs, *, calls, checked=lambda name: True):
  """The row of one workload: each of ``fns`` (name -> jitted fn) run on ``sets[0]`` and
  checked against ``refs`` with the workload's tolerance (where ``checked(name)``), then all
  that ran timed together. A variant that raises is reported and left out; one that misses
  the tolerance is timed and listed in ``failed``."""
  good, failed = {}, []
  for name, fn in fns.items():
    try:
      outs = fn(*sets[0])
      if checked(name):
        checks = [run.check(o, r, w["atol"], w["rtol"]) for o, r in zip(outs, refs)]
        ok = all(x["ok"] for x in checks)
        if not ok:
          failed.append(name)
        print(f"  {label} {name}: {'PASS' if ok else 'FAIL'} "
              f"{[round(x['within'], 5) for x in checks]}", flush=True)
      good[name] = fn
    except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
      print(f"  {label} {name}: ERROR {type(e).__name__}: {str(e)[:400]}", flush=True)
      traceback.print_exc(limit=3)
  times = device_times_us(list(good.values()), sets, calls=calls)
  row = {"workload": label, "floor_us": floor_us, "failed": failed}
  for name, t in zip(good, times):
    row[name] = t["median_us"]
  print("  " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()
                         if k not in ("workload", "failed")), flush=True)
  return row


def print_table(rows, names):
  """``rows``: dicts with ``workload``, ``floor_us``, a time per variant name and a
  ``failed`` list of the names that missed the tolerance."""
  print("\n| workload | floor us | " + " | ".join(names) + " |")
  print("|---|---|" + "---|" * len(names))
  for r in rows:
    failed = set(r.get("failed", ()))
    cells = [(f"{r['floor_us'] / r[n]:.1%} ({r[n]:.0f})" + (" FAIL" if n in failed else ""))
             if n in r else "-" for n in names]
    print(f"| {r['workload']} | {r['floor_us']:.1f} | " + " | ".join(cells) + " |")
  for n in names:
    fr = [r["floor_us"] / r[n] for r in rows if n in r and n not in r.get("failed", ())]
    if fr:
      print(f"geomean {n}: {math.exp(sum(map(math.log, fr)) / len(fr)):.1%} over {len(fr)}")
