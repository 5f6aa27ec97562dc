"""Merges benchmark result files of one op (runs cut short, ``--workloads`` subsets) into one.

Usage::

    python3 -m benchmarks.merge OUT.json IN1.json IN2.json ...

Rows are taken from the inputs in order (a workload measured twice keeps its last row) and
sorted as in ``workloads.json``; the merged file lists every input's commit, date and copy
ceiling, and ``OUT.md`` is written beside ``OUT.json``.
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys

from benchmarks import run


def _part_commit(part) -> str:
  """The commit of a results file whose rows carry none: its ``commit`` field, or the one
  hash that field names (a merge of runs at one commit)."""
  hashes = set(re.findall(r"\b[0-9a-f]{7,40}\b", part["commit"]))
  return hashes.pop() if len(hashes) == 1 else part["commit"]


def _part_kernels(part) -> str | None:
  """The kernels of a results file whose rows do not name theirs: its ``backend`` when that
  names one (not the entry point, which picks per workload)."""
  backend = part.get("backend")
  return None if backend in (None, run.ENTRY) else backend


def merge(paths):
  parts = []
  for path in paths:
    with open(path) as f:
      parts.append(json.load(f))
  op = parts[0]["op"]
  if any(p["op"] != op for p in parts):
    raise ValueError(f"results of different ops: {sorted({p['op'] for p in parts})}")
  rows = {}
  for part in parts:
    for row in part["rows"]:
      # Each row keeps the commit it was measured at (a merged input's rows carry theirs).
      rows[row["workload"]] = dict(row, commit=row.get("commit") or _part_commit(part),
                                   kernels=row.get("kernels") or _part_kernels(part))
  with open(os.path.join(run.HERE, "workloads.json")) as f:
    spec = json.load(f)
  problem = run.problem_of(op)
  order = [problem.label(w) for w in spec[problem.name + "_backward"]["workloads"]]
  ordered = sorted(rows.values(), key=lambda r: order.index(r["workload"]))
  summary = run.summarize(ordered)
  dates = [d for p in parts for d in p["date"].split(" / ")]
  summary["workloads"] = f"{len(ordered)} (merged from {len(dates)} runs)"
  first = parts[0]
  notes = {p.get("floor_note") for p in parts}
  if len(notes) > 1:  # e.g. a causal run with the dense floor and one with the causal floor
    raise ValueError(f"results computed against different floors: {sorted(map(str, notes))}")
  commits = collections.Counter(r["commit"] for r in ordered)
  meta = {
      "date": " / ".join(dates), "device": first["device"],
      "jax": first["jax"],
      "commit": " / ".join(f"{c} ({n} workloads)" for c, n in commits.items()),
      "ceiling": first["ceiling"], "calls": "/".join(str(p["calls"]) for p in parts),
      "ceilings_TBps": [c for p in parts for c in p.get("ceilings_TBps",
                                                          [round(p["ceiling"]["TBps"], 3)])]}
  if first.get("floor_note"):
    meta["floor_note"] = first["floor_note"]
  return op, meta, ordered, summary


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) < 2:
    print(__doc__, file=sys.stderr)
    return 2
  out, *paths = argv
  op, meta, rows, summary = merge(paths)
  text = run.markdown(op, meta, rows, summary)
  text = text.replace("- copy ceiling:", f"- copy ceilings per run: {meta['ceilings_TBps']} TB/s; "
                      "floors use each run's own\n- copy ceiling (first run):", 1)
  run.write_results(out[:-len(".json")], op, meta, rows, summary, text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
