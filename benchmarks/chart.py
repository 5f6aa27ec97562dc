"""Bar charts of benchmark results: the fraction of the memory floor per workload.

``write_chart(json_path)`` reads a results JSON written by ``benchmarks/run.py`` and writes a
PNG next to it: for each workload the Pallas kernel's and XLA's fraction of the memory floor
(floor time / measured time, so 1.0 is the floor and higher is better) as grouped bars, a line
at 1.0, the geomeans in the legend; the title names the device, date, jax and commit.

matplotlib is optional (``pip install -e '.[bench]' -c constraints.txt``); without it
``write_chart`` prints a one-line note and returns None, so a benchmark run never fails for it.

    python -m benchmarks.chart benchmarks/results/nvidia_h200/*softmax*.json   # redraw these charts
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import textwrap

PALLAS_COLOR, XLA_COLOR = "#1f77b4", "#ff7f0e"
OTHER_KERNEL_COLORS = ("#17becf", "#9467bd", "#8c564b")  # a second kernel family, ...
DPI = 100


def write_chart(json_path, png_path=None):
  """Writes the chart of ``json_path`` to ``png_path`` (default: the same name, ``.png``).

  Returns the PNG's path, or None (with a one-line note) when matplotlib is not installed.
  """
  try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ImportError:
    print(f"chart: matplotlib is not installed, no chart for {json_path} "
          "(pip install -e '.[bench]' -c constraints.txt adds it)")
    return None
  if png_path is None:
    png_path = os.path.splitext(json_path)[0] + ".png"
  with open(json_path) as f:
    res = json.load(f)
  rows = res["rows"]
  labels = [str(r["workload"]) for r in rows]
  pallas = [_num(r.get("pallas_frac_floor")) for r in rows]
  xla = [_num(r.get("xla_frac_floor")) for r in rows]
  summary = res.get("summary", {})
  pallas_gm = _num(summary.get("pallas_frac_floor"), _geomean(pallas))
  xla_gm = _num(summary.get("xla_frac_floor"), _geomean(xla))
  pallas_name = f"Pallas ({res['backend']})" if res.get("backend") else "Pallas"

  n = len(rows)
  fig = Figure(figsize=(max(6.0, 1.6 + 0.55 * n), 4.8), dpi=DPI)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  width = 0.4
  xs = range(n)
  kernels = [r.get("kernels") or res.get("backend") or "?" for r in rows]
  names = list(dict.fromkeys(k for k in kernels if k))
  if len(names) > 1:  # the entry point picked different kernels per workload: one color each
    handles = []
    for name, color in zip(names, [PALLAS_COLOR, *OTHER_KERNEL_COLORS]):
      at = [x for x in xs if kernels[x] == name]
      handles.append(ax.bar([x - width / 2 for x in at], [pallas[x] for x in at], width,
                            color=color, label=f"Pallas ({name})"))
    handles += ax.plot([], [], " ", label=f"Pallas, all: geomean {_pct(pallas_gm)} of floor")
  else:
    handles = [ax.bar([x - width / 2 for x in xs], pallas, width, color=PALLAS_COLOR,
                      label=f"{pallas_name}: geomean {_pct(pallas_gm)} of floor")]
  handles += [
      ax.bar([x + width / 2 for x in xs], xla, width, color=XLA_COLOR,
             label=f"XLA: geomean {_pct(xla_gm)} of floor"),
      ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="memory floor (1.0)")]
  top = max([1.0, *(v for v in pallas + xla if not math.isnan(v))])
  for x, r in zip(xs, rows):
    if r.get("passed") is False:  # a workload whose output check failed
      ax.text(x, top * 1.02, "FAIL", color="red", ha="center", va="bottom", fontsize=8,
              fontweight="bold")
  ax.set_ylim(0, top * 1.22)  # room for the legend above the floor line
  ax.set_xlim(-0.6, n - 0.4)
  ax.set_xticks(list(xs))
  ax.set_xticklabels(labels, rotation=40, ha="right", rotation_mode="anchor", fontsize=8)
  ax.set_xlabel(_workload_axis(rows))
  ax.set_ylabel("fraction of memory floor (floor / time)")
  ax.grid(axis="y", alpha=0.3)
  ax.set_axisbelow(True)
  ax.legend(handles=handles, loc="upper left", fontsize=8, ncols=min(4, len(handles)),
            framealpha=0.9)
  ax.set_title(_title(res, fig), fontsize=9, loc="left")
  fig.tight_layout()
  fig.savefig(png_path, dpi=DPI)
  return png_path


def _title(res, fig):
  head = f"{res.get('op', '?')}: fraction of the memory floor, Pallas kernel vs XLA"
  tail = (f"{res.get('device', '?')}  |  {_short_dates(str(res.get('date', '?')))}  |  "
          f"jax {res.get('jax', '?')}  |  commit {res.get('commit', '?')}")
  chars = int(fig.get_figwidth() * 14)  # about what fits at fontsize 9
  return "\n".join([head, *textwrap.wrap(tail, chars)])


def _workload_axis(rows):
  """'workload (batch_size, n_heads, ...)': the workload's fields, which run.py writes into each
  row right after "workload" (up to the tolerances), when they match the label's parts."""
  keys = []
  for k in rows[0] if rows else ():
    if k == "workload":
      continue
    if k in ("atol", "rtol", "floor_us", "pallas_us"):
      break
    keys.append(k)
  parts = str(rows[0]["workload"]).split(", ") if rows else []
  return f"workload ({', '.join(keys)})" if keys and len(keys) == len(parts) else "workload"


def _short_dates(text):
  """'2026-11-30T12:03:21+00:00 / 2026-11-30T15:47:03+00:00' -> '2026-11-30 12:03, 15:47 UTC'."""
  try:
    stamps = [datetime.datetime.fromisoformat(p.strip()) for p in text.split(" / ")]
  except ValueError:
    return text
  out, day = [], None
  for s in stamps:
    out.append(s.strftime("%H:%M") if s.date() == day else s.strftime("%Y-%m-%d %H:%M"))
    day = s.date()
  utc = all(s.utcoffset() == datetime.timedelta(0) for s in stamps)
  return ", ".join(out) + (" UTC" if utc else "")


def _num(v, default=math.nan):
  return float(v) if isinstance(v, (int, float)) else default


def _geomean(vals):
  vals = [v for v in vals if v > 0]
  return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else math.nan


def _pct(v):
  return "n/a" if math.isnan(v) else f"{v:.1%}"


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.chart",
      description="Redraws the charts of benchmark results: a PNG next to each JSON.")
  parser.add_argument("paths", nargs="+", metavar="RESULTS.json",
                      help="results written by benchmarks.run")
  paths = parser.parse_args(argv).paths
  for path in paths:
    png = write_chart(path)
    if png is None:
      return 1
    print(f"{png} ({os.path.getsize(png) / 1024:.0f} KB)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
