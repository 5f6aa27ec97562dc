"""Benchmarks the Pallas kernels against the XLA references on the spec's workloads.

Usage (on a GPU, from the root of the checkout to time)::

    PYTHONPATH=. python3 -m benchmarks.run [--op NAME ...] [--quick] [--out DIR]
    python3 -m benchmarks.run --compare OLD_DIR NEW_DIR   # two runs, workload by workload
    python3 -m benchmarks.run --merge OUT_DIR RUN_DIR...  # --workloads runs into one file

For each op and each of its 16 workloads (``pallas_kernels/workloads.json``) it
checks the kernel against the reference (>= 99% of elements within the
workload's tolerance, no NaN/Inf) and times both under ``jax.jit`` the same way
(device time from the profiler, median, input sets rotated so L2 is cold). The
memory floor is the problem's minimum bytes over the copy bandwidth measured in
the same run. Writes ``<out>/<op>.{md,json,png}`` (``<op>_<backend>.*`` with ``--backend``,
then ``_subset`` for a subset of the workloads: :func:`result_name`), by default in
``benchmarks/results/<device>/`` (``nvidia_h200``, as the tuned tables name devices); each
JSON row holds the workload, the kernels that ran, ``pallas_us``, ``xla_us``, the floor
fractions and ``passed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels._timing import copy_ceiling, device_times_us, no_gpu
from pallas_kernels._util import first_paragraph
from jax_ops import reference, registry
from pallas_kernels import _tuning
from pallas_kernels import workloads as wl

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class Problem:
  name: str              # the op's name in the registry and workloads.json
  label: Callable        # workload -> short label
  make_inputs: Callable  # (workload, constants, key) -> args tuple
  floor_bytes: Callable  # (workload, constants) -> minimum DRAM bytes
  kernel: Callable       # (args, workload, constants) -> outputs
  xla: Callable          # (args, workload, constants) -> outputs
  causal: bool = False   # qk_scale_softmax: a causal P


def _problem(op, causal=False):
  """The entry point of ``op`` against its reference backward, on the inputs, floors and
  labels of :mod:`pallas_kernels.workloads`."""
  kw = {"causal": True} if causal else {}
  ref = getattr(reference, op + "_backward_reference")
  return Problem(
      op, lambda w: wl.label(op, w, causal),
      lambda w, c, key: wl.make_inputs(op, w, c, key, causal),
      lambda w, c: wl.floor_bytes(op, w, c, causal),
      lambda args, w, c: _jit_kernel(op, **kw)(*args, wl.scalar(op, w, c)),
      lambda args, w, c: _jit_ref(ref)(*args, wl.scalar(op, w, c)),
      causal)


PROBLEM_ATTENTION = _problem("attention_softmax_dropout_value")


# The backward ``jax_ops.attention_softmax_dropout_value`` runs on rows of >= 512 aligned keys
# (``pallas_kernels.attention_softmax_dropout_value_backward_from_delta``): its forward saved
# P, keep and the fp32 output instead of Pd, so its backward is delta = rowsum(dO * O) and
# one kernel that reads 5 B per element. Timed on all 16 workloads to show where it pays.
FROM_DELTA = "attention_softmax_dropout_value_from_delta"
FROM_DELTA_FLOOR_NOTE = ("the entry point's (7 B per element: P, Pd, keep and dS); this "
                         "backward reads P and keep and writes dS (5 B), its delta "
                         "from the fp32 output the op's forward saved; Pallas time includes "
                         "that delta (an XLA einsum); XLA is the reference backward of the "
                         "same problem")


@functools.partial(jax.jit, static_argnums=(0, 1))
def _from_delta_inputs(dims, p, key):
  d_o, probs, dropped, value, keep = wl.attention_inputs(dims, p, key)
  b, h, kvh, sq, skv, d = dims
  out32 = jnp.einsum("bkgqs,bksd->bqkgd", dropped.reshape(b, kvh, h // kvh, sq, skv), value,
                     preferred_element_type=jnp.float32).reshape(b, sq, h, d)
  return d_o, probs, dropped, value, keep, out32


def _from_delta_backward(d_o, probs, dropped, value, keep, out32, p):
  del dropped  # the op does not save Pd
  # The Triton backend's: it takes the keep mask (the Mosaic GPU one takes the key's seeds).
  backend = registry.get("attention_softmax_dropout_value", "triton")
  return backend.backward_from_output(d_o, probs, value, keep, p, out32)


PROBLEM_FROM_DELTA = Problem(
    "attention_softmax_dropout_value",
    PROBLEM_ATTENTION.label,
    lambda w, c, key: _from_delta_inputs(wl.attention_dims(w, c), c["attention_dropout"], key),
    PROBLEM_ATTENTION.floor_bytes,
    lambda args, w, c: _jitted(_from_delta_backward)(*args, c["attention_dropout"]),
    lambda args, w, c: _jit_ref(reference.attention_softmax_dropout_value_backward_reference)(
        *args[:5], c["attention_dropout"]),
)

PROBLEM_MASKED = _problem("masked_softmax_dropout")
PROBLEMS = {"attention_softmax_dropout_value": PROBLEM_ATTENTION,
            "masked_softmax_dropout": PROBLEM_MASKED,
            "qk_scale_softmax": _problem("qk_scale_softmax")}


@functools.cache
def _jitted(fn, kw=()):
  """``fn`` under ``jax.jit`` with its last positional argument (a Python float) static."""
  run = jax.jit(lambda last, *args: fn(*args, last, **dict(kw)), static_argnums=0)
  return lambda *args: run(args[-1], *args[:-1])


# What is timed (``--backend``): "entry", the kernel entry point ``pallas_kernels.<op>_backward``
# (it picks its kernels per device and problem: ``kernels_used``), or a registry backend of the
# op, whose ``backward`` takes the entry point's positional arguments.
ENTRY = "entry"
BACKEND = [ENTRY]


@functools.cache
def _jit_kernel(op, **kw):
  fn = (getattr(pallas_kernels, op + "_backward") if BACKEND[0] == ENTRY
        else registry.get(op, BACKEND[0]).backward)
  return _jitted(fn, tuple(sorted(kw.items())))


def kernels_used(problem: Problem, args, constants) -> str:
  """The kernels that time a workload: the entry point's choice
  (:func:`pallas_kernels.workloads.entry_kernels`), or the ``--backend`` named."""
  if BACKEND[0] != ENTRY:
    return BACKEND[0]
  return wl.entry_kernels(problem.name, args, constants, causal=problem.causal)


@functools.cache
def _jit_ref(fn):
  return _jitted(fn)


# --- checking, timing, reporting -------------------------------------------------------------

check, input_sets = wl.check, wl.input_sets


def run_problem(problem: Problem, constants, workloads, ceiling_tbps, calls, on_row=None):
  """Checks and times every workload; ``on_row(rows)`` after each (to write partial results)."""
  rows = []
  for index, w in enumerate(workloads):
    t0 = time.perf_counter()
    sets = input_sets(lambda key: problem.make_inputs(w, constants, key), index)
    t1 = time.perf_counter()
    first, n_sets = sets[0], len(sets)
    kernel = lambda *a: problem.kernel(a, w, constants)
    xla = lambda *a: problem.xla(a, w, constants)
    outs, refs = kernel(*first), xla(*first)
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs = refs if isinstance(refs, tuple) else (refs,)
    checks = [check(o, r, w["atol"], w["rtol"]) for o, r in zip(outs, refs)]
    used = kernels_used(problem, first, constants)
    del outs, refs
    t2 = time.perf_counter()
    t_kernel, t_xla = device_times_us([kernel, xla], sets, calls=calls)
    # Host wall seconds of the row's phases: where a run's time goes.
    wall = {"inputs": t1 - t0, "compile_and_check": t2 - t1, "timing": time.perf_counter() - t2}
    floor_us = problem.floor_bytes(w, constants) / (ceiling_tbps * 1e6)
    row = {
        "workload": problem.label(w), **{k: v for k, v in w.items()}, "kernels": used,
        "floor_us": floor_us, "pallas_us": t_kernel["median_us"], "xla_us": t_xla["median_us"],
        "pallas_frac_floor": floor_us / t_kernel["median_us"],
        "xla_frac_floor": floor_us / t_xla["median_us"],
        "speedup": t_xla["median_us"] / t_kernel["median_us"],
        "pallas_kernels_per_call": t_kernel["kernels_per_call"],
        "xla_kernels_per_call": t_xla["kernels_per_call"],
        "timing_split_ok": t_kernel["split_ok"] and t_xla["split_ok"],
        "input_sets": n_sets,
        "checks": checks, "passed": all(c["ok"] for c in checks),
        "wall_s": {k: round(v, 1) for k, v in wall.items()},
    }
    rows.append(row)
    print(f"  {row['workload']:>24}  floor {floor_us:9.1f} us  pallas {row['pallas_us']:9.1f} us "
          f"({row['pallas_frac_floor']:5.1%})  xla {row['xla_us']:9.1f} us "
          f"({row['xla_frac_floor']:5.1%})  x{row['speedup']:5.2f}  "
          f"{'PASS' if row['passed'] else 'FAIL'} {used} "
          f"{min(c['within'] for c in checks):.4%}  "
          f"[{' '.join(f'{k} {v:.0f}s' for k, v in wall.items())}]", flush=True)
    del sets, first
    if on_row is not None:
      on_row(rows)
  return rows


def geomean(xs):
  return float(math.exp(sum(math.log(x) for x in xs) / len(xs)))


def summarize(rows):
  return {"pallas_frac_floor": geomean([r["pallas_frac_floor"] for r in rows]),
          "xla_frac_floor": geomean([r["xla_frac_floor"] for r in rows]),
          "speedup": geomean([r["speedup"] for r in rows]),
          "all_passed": all(r["passed"] for r in rows),
          "min_speedup": min(r["speedup"] for r in rows)}


def write_results(base, op, meta, rows, summary, text=None):
  """Writes ``base.json``, ``base.md`` (``text``, default the markdown table) and, where
  matplotlib is installed, the bar chart ``base.png`` (``benchmarks/chart.py``)."""
  text = markdown(op, meta, rows, summary) if text is None else text
  with open(base + ".json", "w") as f:
    json.dump({"op": op, **meta, "summary": summary, "rows": rows}, f, indent=1)
  with open(base + ".md", "w") as f:
    f.write(text)
  # Imported here so that the benchmark runs without matplotlib (write_chart then prints a note);
  # the results are written by now, so a chart that cannot be drawn costs a note, not the run.
  from benchmarks import chart
  try:
    chart.write_chart(base + ".json", base + ".png")
  except Exception as e:  # noqa: BLE001
    print(f"chart: no chart for {base}.json: {type(e).__name__}: {e}", file=sys.stderr)
  return text


def markdown(op, meta, rows, summary):
  lines = [f"# {op}: Pallas kernel vs XLA reference", "",
           f"- date: {meta['date']}", f"- device: {meta['device']}",
           f"- jax: {meta['jax']}", f"- commit: {meta['commit']}",
           *([f"- Pallas backend: {meta['backend']}"] if meta.get("backend") else []),
           f"- workloads: {summary['workloads']}",
           f"- copy ceiling: {meta['ceiling']['TBps']:.3f} TB/s ({meta['ceiling']['method']}; "
           + ", ".join(f"{k} {v:.3f}" for k, v in meta['ceiling']['all_TBps'].items()) + ")",
           *([f"- floor: {meta['floor_note']}"] if meta.get("floor_note") else []),
           "- times: median device time (JAX profiler, all kernels of a call), "
           f"{meta['calls']} calls, input sets rotated so L2 is cold; % = floor / time", "",
           "| workload | kernels | floor us | Pallas us | Pallas % | XLA us | XLA % | speedup | check |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    within = min(c["within"] for c in r["checks"])
    lines.append(f"| {r['workload']} | {r.get('kernels', meta.get('backend', ''))} | "
                 f"{r['floor_us']:.1f} | {r['pallas_us']:.1f} | "
                 f"{r['pallas_frac_floor']:.1%} | {r['xla_us']:.1f} | {r['xla_frac_floor']:.1%} | "
                 f"{r['speedup']:.2f}x | {'pass' if r['passed'] else 'FAIL'} ({within:.3%}) |")
  lines.append(f"| **geomean** | | | | **{summary['pallas_frac_floor']:.1%}** | | "
               f"**{summary['xla_frac_floor']:.1%}** | **{summary['speedup']:.2f}x** | "
               f"{'all pass' if summary['all_passed'] else 'FAILURES'} |")
  return "\n".join(lines) + "\n"


CAUSAL_FLOOR_NOTE = ("the causal problem's: g and P read once on and below the diagonal only "
                     "(about half of the dense floor's elements), plus Q, K, dQ, dK")


def _commit():
  """The commit of the checkout whose ``pallas_kernels`` is timed (``BENCH_COMMIT``
  overrides it), with ``+local changes`` if its kernels or ops differ from that commit."""
  commit = os.environ.get("BENCH_COMMIT")
  if commit:
    return commit
  tree = os.path.dirname(os.path.dirname(os.path.abspath(pallas_kernels.__file__)))
  git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=tree)
  try:
    head = git("rev-parse", "--short", "HEAD")
  except OSError:
    return "unknown"
  if head.returncode:
    return "unknown"
  dirty = git("diff", "--quiet", "HEAD", "--", "pallas_kernels", "jax_ops").returncode
  return head.stdout.strip() + (" +local changes" if dirty else "")


def results_dir(device_kind: str) -> str:
  """``benchmarks/results/<device>/``: ``"NVIDIA H200"`` -> ``.../nvidia_h200``."""
  return os.path.join(HERE, "results", _tuning.device_dir(device_kind))


def compare(old_dir: str, new_dir: str, *, slower: float = 1.03) -> list[dict]:
  """Per results JSON in both folders (this script's and ``benchmarks.step``'s), per row (a
  workload or a step shape): the Pallas time of each run and new / old. Prints the rows, a
  ``SLOWER`` mark where new / old exceeds ``slower``, and the geomean per file."""
  out = []
  for name in sorted(f for f in os.listdir(new_dir) if f.endswith(".json")):
    if not os.path.exists(os.path.join(old_dir, name)):
      continue
    runs = []
    for folder in (old_dir, new_dir):
      with open(os.path.join(folder, name)) as f:
        res = json.load(f)
      runs.append((res, {r.get("workload", r.get("step")): r for r in res.get("rows", [])}))
    (old, old_rows), (new, new_rows) = runs
    print(f"{name}: {old.get('commit')} ({old.get('device')}) -> {new.get('commit')} "
          f"({new.get('device')})")
    ratios = []
    for label, row in new_rows.items():
      if label not in old_rows or "pallas_us" not in row:
        continue
      before, after = old_rows[label]["pallas_us"], row["pallas_us"]
      ratio = after / before
      ratios.append(ratio)
      item = {"file": name, "row": label, "old_us": before, "new_us": after, "ratio": ratio,
              "passed": row.get("passed", True)}
      out.append(item)
      print(f"  {label:>40}  {before:9.1f} -> {after:9.1f} us  x{ratio:5.3f}"
            + ("  SLOWER" if ratio > slower else "") + ("" if item["passed"] else "  FAIL"))
    if ratios:
      print(f"  {'geomean':>40}  x{geomean(ratios):5.3f} over {len(ratios)}")
  return out


def merge(out_dir: str, dirs: list[str]) -> list[str]:
  """Joins the ``--workloads`` runs of one tree (one results folder each, say one per device
  call) into one file per op in ``out_dir``: rows in the workloads' order, the summary
  recomputed, ``_subset`` dropped from the name once every workload is there. The runs must
  share their device and commit; a workload in two runs keeps the later one. Returns the
  files written (base names)."""
  runs = {}
  os.makedirs(out_dir, exist_ok=True)
  for folder in dirs:
    for name in sorted(os.listdir(folder)):
      if name.endswith(".json"):
        with open(os.path.join(folder, name)) as f:
          res = json.load(f)
        if "workload" in (res.get("rows") or [{}])[0]:
          runs.setdefault(res["op"], []).append(res)
  written = []
  for op, parts in runs.items():
    for key in ("device", "commit", "backend"):
      if len({p.get(key) for p in parts}) > 1:
        values = sorted({str(p.get(key)) for p in parts})
        raise ValueError(f"{op}: the runs differ in {key}: {values}")
    problem = problem_of(op)
    labels = [problem.label(w) for w in wl.problem(problem.name, causal=problem.causal)[1]]
    by_label = {r["workload"]: r for p in parts for r in p["rows"]}
    rows = [by_label[label] for label in labels if label in by_label]
    ceilings = sorted(p["ceiling"]["TBps"] for p in parts)
    summary = summarize(rows)
    summary["workloads"] = (f"{len(rows)} of {len(labels)} (merged from {len(parts)} runs, copy "
                            f"ceilings {ceilings[0]:.3f}-{ceilings[-1]:.3f} TB/s)")
    meta = {k: v for k, v in parts[0].items() if k not in ("op", "summary", "rows")}
    name = result_name(op, meta.get("backend", ENTRY), len(rows) < len(labels))
    write_results(os.path.join(out_dir, name), op, meta, rows, summary)
    written.append(name)
  return written


def problem_of(op: str) -> Problem:
  """The :class:`Problem` of a results file's ``op`` (a registry op or a variant above)."""
  if op == "qk_scale_softmax_causal":
    return _problem("qk_scale_softmax", causal=True)
  return PROBLEM_FROM_DELTA if op == FROM_DELTA else PROBLEMS[op]


def default_ops(backend: str) -> list[str]:
  """The ops a run without ``--op`` times: every op with a Pallas backend ``backend`` (all
  of them for ``"entry"``), and the causal ``qk_scale_softmax`` after ``qk_scale_softmax``."""
  ops = [op for op in PROBLEMS if backend == ENTRY or backend in registry.available(op)]
  if "qk_scale_softmax" in ops:
    ops.insert(ops.index("qk_scale_softmax") + 1, "qk_scale_softmax_causal")
  return ops


def result_name(op: str, backend: str, subset: bool) -> str:
  """The results' base name: ``<op>`` for the entry points, ``<op>_<backend>`` for a named
  backend, then ``_subset`` for a subset of the workloads, so neither replaces the entry
  points' full results."""
  name = op if backend == ENTRY else f"{op}_{backend}"
  return f"{name}_subset" if subset else name


def main(argv=None):
  parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
  parser.add_argument("--op", action="append",
                      choices=sorted(PROBLEMS) + ["qk_scale_softmax_causal", FROM_DELTA],
                      help="op(s) to run; default: every op that has a Pallas kernel, and "
                           "qk_scale_softmax_causal")
  parser.add_argument("--backend", default=ENTRY,
                      help="what to time: 'entry' (the kernel entry points, which pick their "
                           "kernels per device) or a Pallas backend of jax_ops.registry.available")
  parser.add_argument("--out", default=None,
                      help="results folder (default: benchmarks/results/<device>/)")
  parser.add_argument("--calls", type=int, default=30)
  parser.add_argument("--quick", action="store_true", help="first 4 workloads only")
  parser.add_argument("--workloads", default=None,
                      help="comma-separated indices into the op's 16 workloads (default: all; "
                           "the causal op keeps the square ones); results go to <op>_subset.*"
                           " (<op>_<backend>_subset.* with --backend)")
  parser.add_argument("--compare", nargs=2, metavar=("OLD_DIR", "NEW_DIR"),
                      help="compare two results folders workload by workload (no GPU needed)")
  parser.add_argument("--merge", nargs="+", metavar="DIR",
                      help="OUT_DIR RUN_DIR...: join one tree's --workloads runs into one file "
                           "per op in OUT_DIR (no GPU needed)")
  args = parser.parse_args(argv)
  if args.compare:
    compare(*args.compare)
    return 0
  if args.merge:
    if len(args.merge) < 2:
      parser.error("--merge: expected OUT_DIR and at least one RUN_DIR")
    for name in merge(args.merge[0], args.merge[1:]):
      print(os.path.join(args.merge[0], name))
    return 0
  names = {n for op in PROBLEMS for n in registry.available(op)} | {ENTRY}
  if args.backend not in names:
    parser.error(f"--backend: expected one of {sorted(names)}, got {args.backend!r}")
  ops = args.op or default_ops(args.backend)
  if FROM_DELTA in ops and args.backend not in (ENTRY, "triton"):
    parser.error(f"--op {FROM_DELTA} times the Triton backend's backward from the output, "
                 f"not {args.backend!r}")
  if no_gpu("timing the kernels", "the tests run them on CPU instead"):
    return 2
  spec = wl.spec()
  BACKEND[0] = args.backend
  ceiling = copy_ceiling()
  print(f"copy ceiling {ceiling['TBps']:.3f} TB/s via {ceiling['method']} {ceiling['all_TBps']}")
  meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": jax.devices()[0].device_kind, "jax": jax.__version__, "commit": _commit(),
          "ceiling": ceiling, "calls": args.calls, "backend": args.backend}
  args.out = args.out or results_dir(meta["device"])
  os.makedirs(args.out, exist_ok=True)
  summaries = {}
  for op in ops:
    causal = op.endswith("_causal")
    problem = problem_of(op)
    workloads = spec[problem.name + "_backward"]["workloads"]
    if args.workloads:
      workloads = [workloads[int(i)] for i in args.workloads.split(",")]
    if causal:
      workloads = [w for w in workloads if w["seq_len_q"] == w["seq_len_k"]]
    if args.quick:
      workloads = workloads[:4]
    subset = bool(args.workloads or args.quick)
    print(f"{op}:")
    op_meta = (dict(meta, floor_note=CAUSAL_FLOOR_NOTE) if causal
               else dict(meta, floor_note=FROM_DELTA_FLOOR_NOTE) if op == FROM_DELTA else meta)

    def write(rows, op=op, planned=len(workloads), subset=subset, op_meta=op_meta):
      """Results so far; a run cut short, or run on a subset, says so in its file (named by
      :func:`result_name`, so it never replaces the entry points' full results)."""
      summary = summarize(rows)
      summary["workloads"] = f"{len(rows)} of {planned}" + (
          f" (subset: --workloads {args.workloads or ''} {'--quick' if args.quick else ''})"
          if subset else "")
      name = result_name(op, args.backend, subset)
      write_results(os.path.join(args.out, name), op, op_meta, rows, summary)
      return summary

    rows = run_problem(problem, spec[problem.name + "_backward"]["constants"], workloads,
                       ceiling["TBps"], args.calls, on_row=write)
    summaries[op] = write(rows)
  print("\n| op | Pallas geomean % floor | XLA geomean % floor | geomean speedup | min speedup | all pass |")
  print("|---|---|---|---|---|---|")
  for op, s in summaries.items():
    print(f"| {op} | {s['pallas_frac_floor']:.1%} | {s['xla_frac_floor']:.1%} | "
          f"{s['speedup']:.2f}x | {s['min_speedup']:.2f}x | {s['all_passed']} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
