"""The two-pass kernels' tuning runs (candidates: :mod:`pallas_kernels.tune.attention`): the
passes of a workload, the selection per class, the scheme (qk_scale_softmax), the backend
against XLA, and the table.

A workload's record is ``{"key": class, "times": {pass: {candidate key: us}}}``, and, once
the op's step was timed with the table written (:func:`pallas_kernels.tune.common.time_op`),
``"xla"`` and ``"pallas"``: a class whose Pallas times have a geomean over XLA's above 1 gets
``"backend": "xla"``.
"""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _tuning
from pallas_kernels import attention_softmax_dropout_value as asdv
from pallas_kernels import qk_scale_softmax as qks
from pallas_kernels import workloads as wl
from pallas_kernels._util import Dropout, is_hopper
from pallas_kernels.attention_softmax_dropout_value import dispatch as asdv_dispatch
from pallas_kernels.attention_softmax_dropout_value import forward as asdv_forward
from pallas_kernels.qk_scale_softmax.config import PER_HEAD_TUNED_MAX_ROW
from pallas_kernels.tune import common
from pallas_kernels.tune.attention import (ATTENTION, PASS_ENTRY, QK, SHAPE, _with_table,
                                           candidate_key, candidates, fwd_entry, pass_config,
                                           served_keys)

# Per scheme of qk_scale_softmax, the passes whose times add up to one backward.
QK_SCHEMES = {"two_pass": ("two_pass",), "per_head": ("head",), "dl_gemm": ("dl",)}


# ----------------------------------------------------------------------- the passes


def _lazy(make):
  made = []

  def get():
    if not made:
      made.append(make())
    return made[0]
  return get


def _attention_passes(w, constants, make_sets, cands):
  """``({pass: ([(key, fn)], make_pass_sets)}, class)`` of attention_softmax_dropout_value."""
  p = constants["attention_dropout"]
  h = constants["num_attention_heads"]
  b, _, kvh, sq, skv, d = wl.attention_dims(w, constants)

  def views(d_o, probs, dropped, value, keep):
    return (d_o, dropped.reshape(b * h, sq, skv), probs.reshape(b * h, sq, skv),
            keep.reshape(b * h, sq, skv), value.reshape(b * kvh, skv, d))

  base = asdv.default_config(b, h, kvh, sq, skv, d, jnp.bfloat16)
  view_sets = _lazy(lambda: [views(*s) for s in make_sets()])

  def ds_sets():
    out = []
    for d_o, pd3, p3, k3, v3 in view_sets():
      _, dpart = asdv.dv_pass(d_o, pd3, v3, num_heads=h, cfg=base.dv, interpret=False)
      out.append((d_o, p3, k3, v3, dpart))
    return out
  dropout = Dropout.of(p)

  def keyed(entries):
    return [(candidate_key(ATTENTION, e), pass_config(ATTENTION, e, sq, skv)) for e in entries]

  dv = [(c, lambda d_o, pd3, v3, cfg=cfg: asdv.dv_pass(d_o, pd3, v3, num_heads=h, cfg=cfg,
                                                       interpret=False))
        for c, cfg in keyed(cands["dv"])]
  ds = [(c, lambda d_o, p3, k3, v3, dpart, cfg=cfg: asdv.ds_pass(
      d_o, p3, k3, v3, dpart, None, num_heads=h, dropout=dropout, cfg=cfg, interpret=False))
        for c, cfg in keyed(cands["ds"])]
  passes = {"dv": (dv, _lazy(lambda: [(s[0], s[1], s[4]) for s in view_sets()])),
            "ds": (ds, _lazy(ds_sets))}
  forward = _attention_forward(b, h, kvh, sq, skv, d, p)
  if forward is not None:  # the op's forward runs a fused kernel: time it as the op calls it
    rng = jax.random.key(0)
    fwd = [(candidate_key(ATTENTION, e, "fwd"),
            lambda scores, value, cfg=pass_config(ATTENTION, e, sq, skv, "fwd"):
            forward(scores, value, p, rng, block_q=cfg.block_q, block_k=cfg.block_k,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages))
           for e in cands.get("fwd", [])]
    # The bf16 P stands in for the scores.
    passes["fwd"] = (fwd, _lazy(lambda: [(s[1], s[3]) for s in make_sets()]))
  return passes, asdv.length_class(skv)


def _attention_forward(b, h, kvh, sq, skv, d, p):
  """The fused forward kernel the op's forward runs on this device for a problem (its
  residual policy: the Mosaic GPU backend's on a Hopper GPU where those kernels take it, else
  the Triton backend's), with what it writes bound: a function of ``(scores, value, rate,
  rng, **launch)``; ``None`` where the op's forward is the jnp one."""
  mosaic = (is_hopper(jax.devices()[0])
            and asdv_dispatch.mosaic_gpu_reason(b, h, kvh, sq, skv, d, jnp.bfloat16, p,
                                                False) is None)
  policy = (asdv_dispatch.mosaic_gpu_residuals if mosaic
            else asdv_dispatch.triton_residuals)(b, h, kvh, sq, skv, d)
  if policy == asdv_dispatch.FUSED_OUTPUT and mosaic:  # E, its row scales, the fp32 O
    return asdv_forward.attention_softmax_dropout_value_forward_unnormalized
  if policy == asdv_dispatch.FUSED_OUTPUT:  # P, keep, the fp32 O
    return asdv_forward.attention_softmax_dropout_value_forward
  if policy == asdv_dispatch.FUSED_INPUTS:  # P and Pd
    return functools.partial(asdv_forward.attention_softmax_dropout_value_forward,
                             store_dropped=True, store_keep=False, store_f32=False)
  return None


def _qk_passes(w, constants, make_sets, cands, device_kind=None):
  """``({pass: ([(key, fn)], make_pass_sets)}, class)`` of qk_scale_softmax."""
  b, h, sq, sk, d = wl.qk_dims(w, constants)
  scale = jnp.asarray([constants["scaling"]], jnp.float32)
  pk = max(16, pl.next_power_of_2(sk))

  def views(g, q, k, p):
    return (g.reshape(b * h, sq, sk), p.reshape(b * h, sq, sk), q.reshape(b * h, sq, d),
            k.reshape(b * h, sk, d))

  # The table's two-pass entry (whatever scheme the table picks): the baseline to beat.
  base = qks.default_config(sq, sk, d, jnp.bfloat16, device_kind, schemes=("two_pass",))
  view_sets = _lazy(lambda: [views(*s) for s in make_sets()])
  whole = _lazy(lambda: [(g, p, q, k) for g, p, q, k in view_sets()])

  def col_sets():
    out = []
    for g, p, q, k in view_sets():
      _, stats = qks.row_pass(scale, g, p, k, causal=False, cfg=base.row, interpret=False)
      out.append((g, p, q, stats))
    return out

  def keyed(entries):
    return [(candidate_key(QK, e), pass_config(QK, e, sq, sk)) for e in entries]

  row_cands = [c for c in cands["row"] if c["block_k"] != qks.WHOLE_ROW or pk <= 512]
  row = [(c, lambda g, p, k, cfg=cfg: qks.row_pass(
      scale, g, p, k, causal=False, cfg=cfg, interpret=False)) for c, cfg in keyed(row_cands)]
  col = [(c, lambda g, p, q, stats, cfg=cfg: qks.col_pass(
      scale, g, p, q, stats, causal=False, cfg=cfg, interpret=False))
         for c, cfg in keyed(cands["col"])]
  passes = {"row": (row, _lazy(lambda: [(g, p, k) for g, p, _, k in view_sets()])),
            "col": (col, _lazy(col_sets))}
  # The whole backward with the table's two-pass config: the baseline the schemes must beat.
  passes["two_pass"] = ([("table", lambda g, p, q, k: qks.qk_scale_softmax_backward(
      g[None], q[None], k[None], p[None], constants["scaling"], causal=False, config=base,
      interpret=False))], whole)
  if pk <= PER_HEAD_TUNED_MAX_ROW:
    head = [(c, lambda g, p, q, k, cfg=cfg: qks.head_pass(
        scale, g, p, q, k, causal=False, cfg=cfg, interpret=False))
            for c, cfg in keyed(cands["head"])]
    passes["head"] = (head, whole)
  if sk <= qks.MAX_DL_ROW:
    passes["dl"] = (_dl_candidates(base, sk, constants["scaling"], cands["dl"]), whole)
  shapes = (jax.ShapeDtypeStruct((b, h, sq, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, h, sk, d), jnp.bfloat16))
  if qks.dispatch.pick_forward(*shapes, constants["scaling"]) == "triton":
    fwd = [(candidate_key(QK, e, "fwd"), lambda q, k, cfg=pass_config(QK, e, sq, sk, "fwd"):
            qks.forward.qk_scale_softmax_forward(q, k, constants["scaling"], config=cfg))
           for e in cands.get("fwd", [])]
    passes["fwd"] = (fwd, _lazy(lambda: [(q, k) for _, q, k, _ in make_sets()]))
  return passes, qks.length_class(sk)


def _dl_candidates(base, seq_k, scaling, entries):
  """``[(key, fn)]``: the whole backward on the ``dl_gemm`` scheme, one per distinct dL
  launch of ``entries`` at this row length (``dl_config`` caps rows and warps)."""
  out, seen = [], set()
  for entry in entries:
    if entry.get("phased") and seq_k % 8 == 0:
      continue
    dl = qks.dl_config(entry, seq_k)
    if dl in seen:
      continue
    seen.add(dl)
    cfg = qks.Config(base.row, base.col, "dl_gemm", dl)
    out.append((tuple(entry.items()), lambda g, p, q, k, cfg=cfg: qks.qk_scale_softmax_backward(
        g[None], q[None], k[None], p[None], scaling, causal=False, config=cfg,
        interpret=False)))
  return out


PASSES = {ATTENTION: _attention_passes, QK: _qk_passes}


def length_class(op: str, constants: dict, w: dict) -> str:
  if op == ATTENTION:
    return asdv.length_class(w["seq_len_kv"])
  return qks.length_class(w["seq_len_k"])


def from_shape(op: str, values: tuple) -> tuple[dict, dict]:
  """``(constants, workload)`` of a shape: attention_softmax_dropout_value
  ``B,H,KVH,Sq,Skv,D`` (the spec's dropout rate), qk_scale_softmax ``B,H,Sq,Sk,D`` (scale
  ``D ** -0.5``)."""
  n = len(SHAPE[op].split(","))
  if len(values) != n:
    raise ValueError(f"--shape for {op}: expected {SHAPE[op]}, got {','.join(map(str, values))}")
  v = [int(x) for x in values]
  constants, _ = wl.problem(op)
  if op == ATTENTION:
    c = dict(constants, num_attention_heads=v[1], num_key_value_heads=v[2], head_dim=v[5])
    return c, {"batch_size": v[0], "seq_len_q": v[3], "seq_len_kv": v[4], "atol": 1e-5,
               "rtol": 0.05}
  c = dict(constants, num_heads=v[1], head_dim=v[4], scaling=v[4] ** -0.5)
  return c, {"batch_size": v[0], "seq_len_q": v[2], "seq_len_k": v[3], "atol": 1e-5,
             "rtol": 0.05}


def run_workload(op, constants, w, index, measure, *, quick=False, calls=8, cands=None,
                 passes=None, device_kind=None, served=None) -> dict:
  """Times a workload's passes (``passes``: only these): its record. ``served``: the
  device's table as the run found it, whose entry for the class each pass also times."""
  key = length_class(op, constants, w)
  entry = _tuning.lookup(served or {}, key) or {}
  kept = served_keys(op, entry)
  cands = _with_table(op, candidates(op, quick, cands), kept)
  make_sets = common.lazy_sets(op, constants, w, index)
  extra = {"device_kind": device_kind} if op == QK else {}
  built, key = PASSES[op](w, constants, make_sets, cands, **extra)
  times = {}
  line = [f"{wl.label(op, w):>18} [{key}]"]
  for name, (pass_cands, pass_sets) in built.items():
    if passes and name not in passes:
      continue
    trial = common.Trial(op, key, name, constants, w)
    times[name] = measure(trial, pass_cands, pass_sets, calls=calls)
    line.append(f"{name}: " + " ".join(f"{common.label(c)}={t:.1f}"
                                       for c, t in times[name].items()))
  print("  ".join(line), flush=True)
  record = {"key": key, "times": times, "served": kept}
  causal_dl = entry.get("causal_dl")
  if op == QK and causal_dl is not None:   # not timed: kept as the served entry has it
    record["causal_dl"] = dict(causal_dl)
  return record


# ----------------------------------------------------------------------- the table


def attention_table_entry(entry: dict) -> dict:
  """A class's entry of attention_softmax_dropout_value's table as ``default_config`` reads it
  (``Config.from_json(...).to_json()``) and, if measured, the forward's ``fwd`` as
  ``forward_config`` reads it; raises if it is not one."""
  out = asdv.Config.from_json(entry).to_json()
  if "fwd" in entry:
    out["fwd"] = fwd_entry(ATTENTION, entry["fwd"])
  return out


def qk_table_entry(entry: dict) -> dict:
  """A class's entry of qk_scale_softmax's table (``scheme``, ``row``, ``col`` and, if
  measured, ``head`` and the forward's ``fwd``; ``dl`` and ``causal_dl``, the dL kernel's
  launch for dense and causal calls, kept as they are) as ``default_config`` and
  ``forward_config`` read it; raises if it is not one."""
  scheme = entry.get("scheme", "two_pass")
  if scheme not in qks.SCHEMES:
    raise ValueError(f"scheme: expected one of {qks.SCHEMES}, got {scheme!r}")
  out = {"scheme": scheme}
  for name in ("row", "col", "head"):
    if name in entry:
      out[name] = PASS_ENTRY[QK](entry[name])
    elif name != "head":
      raise KeyError(f"no {name!r} pass")
  if "fwd" in entry:
    out["fwd"] = fwd_entry(QK, entry["fwd"])
  for name in ("dl", "causal_dl"):
    if name in entry:
      fields = {k: entry[name][k] for k in ("rows", "num_warps", "phased") if k in entry[name]}
      qks.DlConfig(**fields)  # raises on a bad value
      out[name] = dict(entry[name])
  return out


TABLE_ENTRY = {ATTENTION: attention_table_entry, QK: qk_table_entry}


def _choose_scheme(best_times):
  """``best_times[pass]`` = per-workload best times of one class -> (scheme, {scheme: geomean
  of its time / the best scheme's time}); a scheme counts only if measured on every workload."""
  totals = {}
  for scheme, names in QK_SCHEMES.items():
    if all(n in best_times and None not in best_times[n] for n in names):
      totals[scheme] = [sum(ts) for ts in zip(*(best_times[n] for n in names))]
  if not totals:
    return None, {}
  best = [min(ts) for ts in zip(*totals.values())]
  score = {s: math.exp(sum(math.log(t / b) for t, b in zip(ts, best)) / len(best))
           for s, ts in totals.items()}
  return min(score, key=score.get), {s: round(v, 4) for s, v in score.items()}


def select(ratios, best_times=None, served=None) -> tuple[dict, dict]:
  """ratios[class][pass] = list of {candidate: time / best} dicts, one per workload;
  best_times[class][pass] = that pass's best time per workload (qk_scale_softmax: picks the
  scheme); served[class][pass] = the candidate key of the entry that served the class (a
  pass's winner is at most ``common.KEEP_SLACK`` slower than it on each workload).
  -> ``({class: {pass: entry, ["scheme": ...]}}, {class: {note: geomean}})``."""
  table, notes = {}, {}
  for key, passes in ratios.items():
    entry, note = {}, {}
    if best_times is not None:
      scheme, scores = _choose_scheme(best_times.get(key, {}))
      if scheme is not None:
        entry["scheme"], note["scheme_geomean_vs_best"] = scheme, scores
    for name, per_workload in passes.items():
      if name == "two_pass":
        continue
      best, score = common.best_by_geomean(
          per_workload, keep=((served or {}).get(key) or {}).get(name))
      if best is None:
        continue
      entry[name] = dict(best)
      note[f"{name}_geomean_vs_best"] = score
    if entry:
      table[key], notes[key] = entry, note
  return table, notes


def records_to_ratios(records: dict[str, list[dict]]):
  """``(ratios, best_times)`` for :func:`select` from the records of each class."""
  ratios, best_times = {}, {}
  for key, rs in records.items():
    for r in rs:
      for name, times in r["times"].items():
        best_times.setdefault(key, {}).setdefault(name, []).append(
            min(times.values()) if times else None)
        if times:
          ratios.setdefault(key, {}).setdefault(name, []).append(common.ratios_of(times))
  return ratios, best_times


def _write_table(op, ratios, out, best_times=None, device_kind=None, records=None, show=None,
                 served=None):
  """Writes the selected entries (configs only; the passes of a class not measured in this
  run, and the classes not measured, keep their entries from the table already at ``out``),
  with each class's backend where ``records`` give its op times (Pallas and XLA), and prints the
  notes (of the classes in ``show``; default all)."""
  table, notes = select(ratios, best_times, served)
  if op == QK:  # a dl_gemm class whose dL launch this run did not time keeps its scheme
    old = common.read_table(out, device_kind or _device_kind())
    for key in table:
      if (old.get(key, {}).get("scheme") == "dl_gemm" and "scheme" in table[key]
          and "dl" not in ratios.get(key, {})):
        table[key].pop("scheme")
        notes[key]["scheme"] = "dl_gemm kept from the table (dl not timed in this run)"
    # The causal dL launch is not timed: a class that has none at ``out`` takes the one of
    # the table that served this device when the run began (say, its architecture's
    # measured device's; the records carry it).
    for key in table:
      causal_dl = next((r["causal_dl"] for r in (records or {}).get(key, [])
                        if "causal_dl" in r), None)
      if causal_dl is not None and "causal_dl" not in old.get(key, {}):
        table[key]["causal_dl"] = dict(causal_dl)
  for key, rs in (records or {}).items():
    if key in table:
      backend, score = common.choose_backend([r.get("pallas") for r in rs],
                                             [r.get("xla") for r in rs])
      if backend is not None:
        table[key]["backend"] = backend
        notes[key]["op_pallas_vs_xla_geomean"] = score
  for key in (k for k in table if show is None or k in show):
    print(f"  selected {key}: " + "  ".join(
        f"{name}={common.label(tuple(v.items())) if isinstance(v, dict) else v}"
        for name, v in table[key].items()) + f"  {json.dumps(notes[key])}", flush=True)
  return common.write_table(table, out, entry_json=TABLE_ENTRY[op], merge=True,
                            per_field=True, device_kind=device_kind)


def _device_kind():
  return jax.devices()[0].device_kind


def write(op: str, records: dict[str, list[dict]], out: str, device_kind: str,
          show=None) -> dict:
  """Selects per class from the workloads' records and writes the table (prints the
  selection of the classes in ``show``)."""
  ratios, best_times = records_to_ratios(records)
  served = common.served_of(records)
  return _write_table(op, ratios, out, best_times if op == QK else None, device_kind, records,
                      show, served)
