"""Merges benchmark result files of one op (runs cut short, ``--workloads`` subsets) into one.

Usage::

    python3 -m benchmarks.merge OUT.json IN1.json IN2.json ...

Rows are taken from the inputs in order (a workload measured twice keeps its last row) and
sorted as in ``workloads.json``; the merged file lists every input's commit, date and copy
ceiling, and ``OUT.md`` is written beside ``OUT.json``.
"""

from __future__ import annotations

import json
import os
import sys

from benchmarks import run


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
      rows[row["workload"]] = row
  with open(os.path.join(run.HERE, "workloads.json")) as f:
    spec = json.load(f)
  problem = run._c_problem(True) if op.endswith("_causal") else run.PROBLEMS[op]
  order = [problem.label(w) for w in spec[problem.name + "_backward"]["workloads"]]
  ordered = sorted(rows.values(), key=lambda r: order.index(r["workload"]))
  summary = run.summarize(ordered)
  summary["workloads"] = f"{len(ordered)} (merged from {len(parts)} runs)"
  first = parts[0]
  meta = {
      "date": " / ".join(p["date"] for p in parts), "device": first["device"],
      "jax": first["jax"],
      "commit": " / ".join(f"{p['commit']} ({len(p['rows'])} workloads)" for p in parts),
      "ceiling": first["ceiling"], "calls": "/".join(str(p["calls"]) for p in parts),
      "ceilings_TBps": [round(p["ceiling"]["TBps"], 3) for p in parts]}
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
