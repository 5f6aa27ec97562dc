"""Tunes the two passes of the attention kernels (problems A and C) on this GPU.

Usage (on a GPU)::

    PYTHONPATH=. python3 -m benchmarks.tune_attention --op attention_softmax_dropout_value
    PYTHONPATH=. python3 -m benchmarks.tune_attention --op qk_scale_softmax

Each kernel runs as two Pallas calls (A: dV + delta, then dS; C: delta + grad_query,
then grad_key); they are timed apart, each over a list of candidate tiles and launch
parameters, on a spread of the op's workloads (inputs rotated so L2 is cold). For each
length class of the kernel (``length_class``) the table keeps, per pass, the candidate
with the best geomean of time / best time over the class's workloads, and is written
after every workload (``pallas_kernels/tuned/<op>.json``, used when the device matches).
``--passes`` limits the run to some passes.

A's pass 1 is timed with delta's partials. Where the dS pass takes a whole row in one tile
it needs none, and pass 1 then runs without its dPd GEMM; the tuner does not time that
pairing: the table's "128" entry (one-tile dS rows, a dV-only pass 1) was chosen from
``benchmarks/results/attention_dv_only.log``, and re-tuning that class replaces it.

For C the tuner also times the whole backward with the table's two-pass config and, for
rows of <= 256 keys, the one-kernel ``per_head`` scheme (pass ``head``); the table's
``scheme`` for a class is the one with the best geomean over its workloads.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys

import jax
import jax.numpy as jnp

from benchmarks import run as bench
from benchmarks.timing import compile_all, device_times_us
from benchmarks.tune import best_by_geomean, write_table
from pallas_kernels import _tuning
from pallas_kernels import attention_softmax_dropout_value as asdv
from pallas_kernels import qk_scale_softmax as qks

# PassConfig fields: (block_q, block_kv, warps, stages[, prefetch, split, heads, row_align])
A_DV = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 3),
        (128, 128, 8, 2), (32, 64, 4, 3), (128, 64, 8, 2), (64, 128, 4, 2), (32, 128, 4, 3)]
# dV pass: split=1 vs the automatic split (0, the default).
A_DV += [(64, 64, 4, 3, False, 1), (128, 64, 8, 2, False, 1), (64, 128, 4, 2, False, 1),
         (64, 32, 4, 3)]
# Explicit larger splits: small ragged launches run one partial wave at 250 registers per
# program (benchmarks/results/attention_softmax_dropout_value_profile.log).
A_DV += [(64, 64, 4, 3, False, 4), (64, 64, 4, 3, False, 8), (128, 64, 8, 2, False, 4)]
# 128 x 128 tiles with 3 stages: 0.90 of 64x64/4w/3s on rows of >= 1024 keys
# (benchmarks/results/attention_dv_only.log, section 6).
A_DV += [(128, 128, 8, 3)]
A_DS = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2),
        (64, 128, 8, 3), (128, 32, 4, 3), (256, 64, 8, 2), (128, 64, 4, 3), (64, 32, 4, 3)]
# Register prefetch on tiles of consecutive rows (row_align=0: on rows of Skv % 8 != 0 the
# default is the phase-aligned kernel, which does not prefetch).
A_DS += [(64, 64, 4, 2, True, 0, 1, 0), (64, 128, 4, 2, True, 0, 1, 0),
         (32, 64, 4, 2, True, 0, 1, 0), (64, 64, 4, 1, True, 0, 1, 0),
         (64, 32, 4, 2, True, 0, 1, 0)]
A_WORKLOADS = [0, 1, 2, 3, 4, 8, 10, 15]
# (block_q, block_k, warps, stages[, prefetch, row_align]); block_k 0 = the whole padded row.
C_ROW = [(16, 0, 4, 1), (32, 0, 4, 1), (32, 0, 8, 1), (64, 0, 8, 1), (16, 128, 4, 2),
         (32, 128, 4, 2), (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3),
         (32, 256, 8, 2), (64, 256, 8, 2)]
C_COL = [(64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 4, 2),
         (128, 128, 8, 2), (32, 64, 4, 3), (64, 128, 8, 3), (128, 64, 4, 3)]
C_ROW += [(32, 128, 4, 2, True, 0), (16, 128, 4, 2, True, 0), (32, 64, 4, 2, True, 0),
          (32, 128, 4, 1, True, 0), (32, 64, 4, 2, False, 16)]
C_COL += [(32, 64, 4, 3, True), (32, 64, 4, 2, True), (64, 64, 4, 2, True),
          (32, 128, 4, 2, True)]
C_WORKLOADS = [0, 1, 2, 4, 8, 9, 10, 13, 14]
# Kernel C's "per_head" scheme (one program per head, rows <= 256 keys): (block_q, 0, warps, stages).
C_HEAD = [(16, 0, 4, 2), (32, 0, 4, 2), (32, 0, 8, 2), (64, 0, 8, 2), (16, 0, 8, 2),
          (32, 0, 16, 2), (64, 0, 16, 2), (32, 0, 8, 3), (16, 0, 4, 3), (128, 0, 16, 2)]


def _a_passes(w, constants, sets):
  """``{pass: (candidates, [fn(*set) per candidate], sets)}`` for problem A."""
  p = constants["attention_dropout"]
  h = constants["num_attention_heads"]
  b, _, kvh, sq, skv, d = bench._a_dims(w, constants)

  def views(d_o, probs, dropped, value, keep):
    return (d_o, dropped.reshape(b * h, sq, skv), probs.reshape(b * h, sq, skv),
            keep.reshape(b * h, sq, skv), value.reshape(b * kvh, skv, d))

  base = asdv.default_config(b, h, kvh, sq, skv, d, jnp.bfloat16)
  view_sets = [views(*s) for s in sets]
  dv_sets = [(s[0], s[1], s[4]) for s in view_sets]
  ds_sets = []
  for d_o, pd3, p3, k3, v3 in view_sets:
    _, dpart = asdv.dv_pass(d_o, pd3, v3, num_heads=h, cfg=base.dv, interpret=False)
    ds_sets.append((d_o, p3, k3, v3, dpart))
  dropout = ("static", 1.0 / (1.0 - p))
  cap_q, cap_kv = max(16, asdv.next_power_of_2(sq)), max(16, asdv.next_power_of_2(skv))

  def capped(c):
    return asdv.PassConfig(min(c[0], cap_q), min(c[1], cap_kv), *c[2:])

  dv = [(c, lambda d_o, pd3, v3, cfg=capped(c): asdv.dv_pass(d_o, pd3, v3, num_heads=h, cfg=cfg,
                                                             interpret=False)) for c in A_DV]
  ds = [(c, lambda d_o, p3, k3, v3, dpart, cfg=capped(c): asdv.ds_pass(
      d_o, p3, k3, v3, dpart, None, num_heads=h, dropout=dropout, cfg=cfg, interpret=False))
        for c in A_DS]
  return {"dv": (dv, dv_sets), "ds": (ds, ds_sets)}, asdv.length_class(skv)


def _c_passes(w, constants, sets):
  b, h, sq, sk, d = bench._c_dims(w, constants)
  scale = jnp.asarray([constants["scaling"]], jnp.float32)
  pk = max(16, qks.next_power_of_2(sk))
  cap_q = max(16, qks.next_power_of_2(sq))

  def views(g, q, k, p):
    return (g.reshape(b * h, sq, sk), p.reshape(b * h, sq, sk), q.reshape(b * h, sq, d),
            k.reshape(b * h, sk, d))

  # The table's two-pass entry (whatever scheme the table picks): the baseline to beat.
  base = qks.default_config(sq, sk, d, jnp.bfloat16, jax.devices()[0].device_kind,
                            schemes=("two_pass",))
  view_sets = [views(*s) for s in sets]
  row_sets = [(g, p, k) for g, p, _, k in view_sets]
  col_sets = []
  for g, p, q, k in view_sets:
    _, delta = qks.row_pass(scale, g, p, k, causal=False, cfg=base.row, interpret=False)
    col_sets.append((g, p, q, delta))

  def capped(c):
    return qks.PassConfig(min(c[0], cap_q), pk if c[1] == 0 else min(c[1], pk), *c[2:])

  row_cands = [c for c in C_ROW if c[1] != 0 or pk <= 512]
  row = [(c, lambda g, p, k, cfg=capped(c): qks.row_pass(
      scale, g, p, k, causal=False, cfg=cfg, interpret=False)) for c in row_cands]
  col = [(c, lambda g, p, q, delta, cfg=capped(c): qks.col_pass(
      scale, g, p, q, delta, causal=False, cfg=cfg, interpret=False)) for c in C_COL]
  passes = {"row": (row, row_sets), "col": (col, col_sets)}
  # The whole backward with the table's two-pass config: the baseline the schemes must beat.
  passes["two_pass"] = ([(("table",), lambda g, p, q, k: qks._backward(
      g[None], q[None], k[None], p[None], constants["scaling"], causal=False, config=base,
      interpret=False))], [(g, p, q, k) for g, p, q, k in view_sets])
  if pk <= 256:
    head = [(c, lambda g, p, q, k, cfg=capped(c): qks.head_pass(
        scale, g, p, q, k, causal=False, cfg=cfg, interpret=False)) for c in C_HEAD]
    passes["head"] = (head, [(g, p, q, k) for g, p, q, k in view_sets])
  return passes, qks.length_class(sk)


# Candidate lists per op and pass (``--cands`` replaces them for one run).
CANDIDATES = {
    "attention_softmax_dropout_value": {"dv": A_DV, "ds": A_DS},
    "qk_scale_softmax": {"row": C_ROW, "col": C_COL, "head": C_HEAD},
}

# Per scheme of kernel C, the passes whose times add up to one backward.
C_SCHEMES = {"two_pass": ("two_pass",), "per_head": ("head",)}


OPS = {
    "attention_softmax_dropout_value": (bench.PROBLEM_A, A_WORKLOADS, _a_passes,
                                        _tuning.table_path("attention_softmax_dropout_value")),
    "qk_scale_softmax": (bench.PROBLEMS["qk_scale_softmax"], C_WORKLOADS, _c_passes,
                         _tuning.table_path("qk_scale_softmax")),
}


def _label(c, cls):
  """``64x128/4w/2s`` plus the ``cls`` (PassConfig) fields that differ from the defaults."""
  if len(c) < 4:
    return "/".join(map(str, c))
  label = f"{c[0]}x{c[1]}/{c[2]}w/{c[3]}s"
  extra = cls(*c)._asdict()
  defaults = cls._field_defaults
  for name in list(extra)[4:]:
    if extra[name] != defaults[name]:
      label += f"/{name}" if extra[name] is True else f"/{name}={extra[name]}"
  return label


def _choose_scheme(best_times):
  """``best_times[pass]`` = per-workload best times of one class -> (scheme, {scheme: geomean
  of its time / the best scheme's time}); a scheme counts only if measured on every workload."""
  totals = {}
  for scheme, names in C_SCHEMES.items():
    if all(n in best_times and None not in best_times[n] for n in names):
      totals[scheme] = [sum(ts) for ts in zip(*(best_times[n] for n in names))]
  if not totals:
    return None, {}
  best = [min(ts) for ts in zip(*totals.values())]
  score = {s: math.exp(sum(math.log(t / b) for t, b in zip(ts, best)) / len(best))
           for s, ts in totals.items()}
  return min(score, key=score.get), {s: round(v, 4) for s, v in score.items()}


def _write_table(ratios, out, best_times=None):
  """ratios[class][pass] = list of {candidate: time / best} dicts, one per workload;
  best_times[class][pass] = that pass's best time per workload (kernel C: picks the scheme).

  Classes not measured in this run keep their entries from the table already at ``out``.
  """
  table = {}
  for key, passes in ratios.items():
    entry = {}
    for name, per_workload in passes.items():
      if name == "two_pass":
        continue
      best, score = best_by_geomean(per_workload)
      if best is None:
        continue
      entry[name] = list(best)
      entry[f"{name}_geomean_vs_best"] = score
    if best_times is not None:
      scheme, scores = _choose_scheme(best_times.get(key, {}))
      if scheme is not None:
        entry["scheme"], entry["scheme_geomean_vs_best"] = scheme, scores
    table[key] = entry
  return write_table(table, out, merge=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--op", required=True, choices=sorted(OPS))
  parser.add_argument("--out", default=None)
  parser.add_argument("--calls", type=int, default=8)
  parser.add_argument("--passes", default=None,
                      help="comma-separated passes to tune (default: all of the op's)")
  parser.add_argument("--workloads", default=None,
                      help="comma-separated workload indices (default: a fixed spread)")
  parser.add_argument("--cands", default=None,
                      help="replace candidate lists, e.g. 'ds=[(64,64,4,2),(64,64,4,2,True)];dv=[...]' "
                           "(tuples in the pass's PassConfig field order)")
  args = parser.parse_args(argv)
  if args.cands:
    for item in args.cands.split(";"):
      name, _, value = item.partition("=")
      CANDIDATES[args.op][name.strip()][:] = ast.literal_eval(value)
  if jax.default_backend() != "gpu":
    print("tuning needs a CUDA GPU", file=sys.stderr)
    return 2
  problem, indices, passes_fn, default_out = OPS[args.op]
  config_cls = asdv.PassConfig if args.op == "attention_softmax_dropout_value" else qks.PassConfig
  out = args.out or default_out
  if args.workloads:
    indices = [int(i) for i in args.workloads.split(",")]
  with open(os.path.join(bench.HERE, "workloads.json")) as f:
    spec = json.load(f)[problem.name + "_backward"]
  constants, workloads = spec["constants"], spec["workloads"]
  ratios: dict[str, dict[str, list[dict]]] = {}
  best_times: dict[str, dict[str, list]] = {}
  result = None
  for index in indices:
    w = workloads[index]
    first = problem.make_inputs(w, constants, jax.random.key(9000 + 100 * index))
    set_bytes = sum(x.size * x.dtype.itemsize for x in first)
    n_sets = int(min(16, max(2, math.ceil(bench._ROTATE_BYTES / set_bytes))))
    sets = [first] + [problem.make_inputs(w, constants, jax.random.key(9000 + 100 * index + i))
                      for i in range(1, n_sets)]
    passes, key = passes_fn(w, constants, sets)
    line = [f"{problem.label(w):>18} [{key}]"]
    for name, (cands, pass_sets) in passes.items():
      if args.passes and name not in args.passes.split(","):
        continue
      compiled = compile_all([fn for _, fn in cands], pass_sets[0])
      ok = []
      for (cand, _), exe in zip(cands, compiled):
        if exe is None:
          continue
        try:
          jax.block_until_ready(exe(*pass_sets[0]))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory at launch
          print(f"  {name} {cand}: launch failed: {str(e).splitlines()[0][:160]}", flush=True)
          continue
        ok.append((cand, exe))
      if not ok:
        best_times.setdefault(key, {}).setdefault(name, []).append(None)
        continue
      times = [t["median_us"] for t in device_times_us([exe for _, exe in ok], pass_sets,
                                                        calls=args.calls, warmup=1)]
      best = min(times)
      best_times.setdefault(key, {}).setdefault(name, []).append(best)
      ratios.setdefault(key, {}).setdefault(name, []).append(
          {cand: t / best for (cand, _), t in zip(ok, times)})
      line.append(f"{name}: " + " ".join(f"{_label(c, config_cls)}={t:.1f}"
                                         for (c, _), t in zip(ok, times)))
    print("  ".join(line), flush=True)
    result = _write_table(ratios, out, best_times if args.op == "qk_scale_softmax" else None)
  print(json.dumps(result, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
