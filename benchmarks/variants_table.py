"""The table that the variant scripts (``a_mosaic_variants``, ``c_mosaic_variants``) print:
per workload, each variant's fraction of the floor and time; a variant that missed the
tolerance on a workload is marked ``FAIL`` there and left out of its geomean."""

from __future__ import annotations

import math


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
