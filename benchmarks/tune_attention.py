"""Tunes the passes of the attention_softmax_dropout_value and qk_scale_softmax kernels.

Usage (on a GPU)::

    PYTHONPATH=. python3 -m benchmarks.tune_attention --op attention_softmax_dropout_value
    PYTHONPATH=. python3 -m benchmarks.tune_attention --op qk_scale_softmax

Each kernel runs as two Pallas calls (attention_softmax_dropout_value: dV + delta, then dS;
qk_scale_softmax: delta + grad_query, then grad_key); they are timed apart, each over a list
of candidate tiles and launch parameters, on a spread of the op's workloads (inputs rotated
so L2 is cold). For each length class of the kernel (``length_class``) the table keeps, per
pass, the candidate with the best geomean of time / best time over the class's workloads,
and is written after every workload (default ``pallas_kernels/tuned/<device>/<op>.json``,
the folder of ``jax.devices()[0].device_kind``; used when the device matches). ``--passes``
limits the run to some passes; the passes not tuned keep their entries from the table
already there.

The table holds configs only, with named fields, as the op's ``default_config`` reads
them (attention_softmax_dropout_value: ``Config.to_json()``, ``{"dv": {...}, "ds": {...}}``;
qk_scale_softmax: ``{"scheme": ..., "row": {...}, "col": {...}, "head": {...}}`` of
``qk_scale_softmax.table_entry``). The notes (each pass's ``geomean_vs_best``, the schemes'
geomeans, the times) are printed.

A candidate is a pass's table entry: its ``PassConfig`` fields by name (fields left out
take their defaults; qk_scale_softmax's ``"block_k": "row"`` (``WHOLE_ROW``) is a whole
padded row as one tile). ``--cands`` replaces the lists for one run; it takes positional
tuples (``TUPLE_FIELDS``; attention_softmax_dropout_value: ``(block_q, block_k, num_warps,
num_stages[, split, heads, row_align])``, split 0 = ``"auto"``; qk_scale_softmax:
``(block_q, block_k, num_warps, num_stages[, row_align])``, block_k 0 = the whole
row) or dicts of named fields.

attention_softmax_dropout_value's pass 1 is timed with delta's partials. Where the dS pass
takes a whole row in one tile it needs none, and pass 1 then runs without its dPd GEMM; the
tuner does not time that pairing: re-tuning the table's "128" class (one-tile dS rows, a
dV-only pass 1) replaces its entry with a two-pass one.

For qk_scale_softmax the tuner also times the whole backward with the table's two-pass
config, for rows of <= 256 keys the one-kernel ``per_head`` scheme (pass ``head``), and the
``dl_gemm`` scheme over the dL kernel's launches (pass ``dl``, :data:`QK_DL`); the table's
``scheme`` for a class is the one with the best geomean over its workloads. The causal dL
launch (``causal_dl``) is not timed: a class keeps the one its table has.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks import run as bench
from pallas_kernels._timing import compile_all, device_times_us, no_gpu
from benchmarks.tune import best_by_geomean, read_table, write_table
from pallas_kernels import _tuning
from pallas_kernels import attention_softmax_dropout_value as asdv
from pallas_kernels import qk_scale_softmax as qks
from pallas_kernels._util import Dropout
from pallas_kernels.attention_softmax_dropout_value.config import AUTO
from pallas_kernels.workloads import spec as workloads_spec

ATTENTION = "attention_softmax_dropout_value"
QK = "qk_scale_softmax"

# attention_softmax_dropout_value: candidates of each pass (asdv.PassConfig fields; split
# "auto" by default).
ATTENTION_DV = [
    dict(block_q=64, block_k=64, num_warps=4, num_stages=2),
    dict(block_q=64, block_k=64, num_warps=4, num_stages=3),
    dict(block_q=32, block_k=128, num_warps=8, num_stages=2),
    dict(block_q=64, block_k=128, num_warps=8, num_stages=2),
    dict(block_q=64, block_k=128, num_warps=8, num_stages=3),
    dict(block_q=128, block_k=128, num_warps=8, num_stages=2),
    dict(block_q=32, block_k=64, num_warps=4, num_stages=3),
    dict(block_q=128, block_k=64, num_warps=8, num_stages=2),
    dict(block_q=64, block_k=128, num_warps=4, num_stages=2),
    dict(block_q=32, block_k=128, num_warps=4, num_stages=3),
]
# dV pass: split=1 vs the automatic split (the default).
ATTENTION_DV += [
    dict(block_q=64, block_k=64, num_warps=4, num_stages=3, split=1),
    dict(block_q=128, block_k=64, num_warps=8, num_stages=2, split=1),
    dict(block_q=64, block_k=128, num_warps=4, num_stages=2, split=1),
    dict(block_q=64, block_k=32, num_warps=4, num_stages=3),
]
# Explicit larger splits: small ragged launches run one partial wave at 250 registers per
# program.
ATTENTION_DV += [
    dict(block_q=64, block_k=64, num_warps=4, num_stages=3, split=4),
    dict(block_q=64, block_k=64, num_warps=4, num_stages=3, split=8),
    dict(block_q=128, block_k=64, num_warps=8, num_stages=2, split=4),
]
# 128 x 128 tiles with 3 stages, for rows of >= 1024 keys.
ATTENTION_DV += [dict(block_q=128, block_k=128, num_warps=8, num_stages=3)]
ATTENTION_DS = [
    dict(block_q=64, block_k=64, num_warps=4, num_stages=2),
    dict(block_q=128, block_k=64, num_warps=8, num_stages=2),
    dict(block_q=128, block_k=64, num_warps=8, num_stages=3),
    dict(block_q=128, block_k=128, num_warps=8, num_stages=2),
    dict(block_q=64, block_k=128, num_warps=4, num_stages=2),
    dict(block_q=64, block_k=128, num_warps=8, num_stages=3),
    dict(block_q=128, block_k=32, num_warps=4, num_stages=3),
    dict(block_q=256, block_k=64, num_warps=8, num_stages=2),
    dict(block_q=128, block_k=64, num_warps=4, num_stages=3),
    dict(block_q=64, block_k=32, num_warps=4, num_stages=3),
]
ATTENTION_WORKLOADS = [0, 1, 2, 3, 4, 8, 10, 15]

# qk_scale_softmax: candidates of each kernel (qks.PassConfig fields); block_k WHOLE_ROW ("row") is
# the whole padded row as one tile (row kernel: timed only on rows of <= 512 keys).
ROW = qks.WHOLE_ROW
QK_ROW = [
    dict(block_q=16, block_k=ROW, num_warps=4, num_stages=1),
    dict(block_q=32, block_k=ROW, num_warps=4, num_stages=1),
    dict(block_q=32, block_k=ROW, num_warps=8, num_stages=1),
    dict(block_q=64, block_k=ROW, num_warps=8, num_stages=1),
    dict(block_q=16, block_k=128, num_warps=4, num_stages=2),
    dict(block_q=32, block_k=128, num_warps=4, num_stages=2),
    dict(block_q=32, block_k=128, num_warps=8, num_stages=3),
    dict(block_q=64, block_k=128, num_warps=8, num_stages=2),
    dict(block_q=32, block_k=64, num_warps=4, num_stages=3),
    dict(block_q=64, block_k=64, num_warps=4, num_stages=3),
    dict(block_q=32, block_k=256, num_warps=8, num_stages=2),
    dict(block_q=64, block_k=256, num_warps=8, num_stages=2),
]
QK_COL = [
    dict(block_q=64, block_k=128, num_warps=8, num_stages=2),
    dict(block_q=32, block_k=128, num_warps=4, num_stages=3),
    dict(block_q=64, block_k=64, num_warps=4, num_stages=3),
    dict(block_q=128, block_k=64, num_warps=8, num_stages=2),
    dict(block_q=64, block_k=128, num_warps=4, num_stages=2),
    dict(block_q=128, block_k=128, num_warps=8, num_stages=2),
    dict(block_q=32, block_k=64, num_warps=4, num_stages=3),
    dict(block_q=64, block_k=128, num_warps=8, num_stages=3),
    dict(block_q=128, block_k=64, num_warps=4, num_stages=3),
]
QK_ROW += [dict(block_q=32, block_k=64, num_warps=4, num_stages=2, row_align=16)]
QK_WORKLOADS = [0, 1, 2, 4, 8, 9, 10, 13, 14]
# qk_scale_softmax's "per_head" scheme (one program per head, rows <= 256 keys, whole rows).
QK_HEAD = [
    dict(block_q=16, block_k=ROW, num_warps=4, num_stages=2),
    dict(block_q=32, block_k=ROW, num_warps=4, num_stages=2),
    dict(block_q=32, block_k=ROW, num_warps=8, num_stages=2),
    dict(block_q=64, block_k=ROW, num_warps=8, num_stages=2),
    dict(block_q=16, block_k=ROW, num_warps=8, num_stages=2),
    dict(block_q=32, block_k=ROW, num_warps=16, num_stages=2),
    dict(block_q=64, block_k=ROW, num_warps=16, num_stages=2),
    dict(block_q=32, block_k=ROW, num_warps=8, num_stages=3),
    dict(block_q=16, block_k=ROW, num_warps=4, num_stages=3),
    dict(block_q=128, block_k=ROW, num_warps=16, num_stages=2),
]
# qk_scale_softmax's "dl_gemm" scheme: its dL kernel's launch (``dl_config`` fields), timed as
# the whole backward; ``phased`` only on rows of ``Sk % 8 != 0`` keys.
QK_DL = [dict(rows=r, num_warps=w) for r in (1, 2, 4, 8) for w in (1, 2, 4, 8)]
QK_DL += [dict(e, phased=True) for e in QK_DL if e["rows"] <= 2]

# Candidate lists per op and pass (``--cands`` replaces them for one run).
CANDIDATES = {
    ATTENTION: {"dv": ATTENTION_DV, "ds": ATTENTION_DS},
    QK: {"row": QK_ROW, "col": QK_COL, "head": QK_HEAD},
}

# The positional order of a ``--cands`` tuple.
TUPLE_FIELDS = {
    ATTENTION: ("block_q", "block_k", "num_warps", "num_stages", "split", "heads", "row_align"),
    QK: ("block_q", "block_k", "num_warps", "num_stages", "row_align"),
}


# ----------------------------------------------------------------------- candidates


def attention_pass_entry(entry: dict) -> dict:
  """A pass candidate of attention_softmax_dropout_value as the table holds it
  (``PassConfig.to_json``: the launch fields, then the others that differ from their
  defaults); raises
  ``ValueError`` naming a bad field."""
  return asdv.PassConfig.from_json(entry).to_json()


def qk_pass_entry(entry: dict) -> dict:
  """A pass candidate of qk_scale_softmax as the table holds it (``table_entry``; a whole-row
  ``block_k`` stays ``WHOLE_ROW``); raises ``ValueError`` naming a bad field."""
  entry = dict(entry)
  whole = entry.get("block_k") == qks.WHOLE_ROW
  if whole:
    entry["block_k"] = 16  # any valid tile: table_entry writes WHOLE_ROW
  names = {f.name for f in dataclasses.fields(qks.PassConfig)}
  unknown = sorted(set(entry) - names)
  if unknown:
    raise ValueError(f"config: unknown fields {unknown}; expected some of {sorted(names)}")
  return qks.table_entry(qks.PassConfig(**entry), whole_row=whole)


PASS_ENTRY = {ATTENTION: attention_pass_entry, QK: qk_pass_entry}


def pass_config(op: str, entry: dict, seq_q: int, seq_k: int):
  """The pass config a candidate runs with on a workload: tiles capped at the padded
  lengths (qk_scale_softmax: a whole-row tile is the padded row), as the op's
  ``default_config`` does."""
  if op == ATTENTION:
    return asdv.PassConfig.from_json(entry).capped(seq_q, seq_k)
  return qks.pass_config(entry, seq_q, seq_k)


def candidate_key(op: str, entry: dict) -> tuple:
  """A candidate as a hashable key (its table entry's items); ``dict(key)`` is the entry."""
  return tuple(PASS_ENTRY[op](entry).items())


def from_tuple(op: str, values) -> dict:
  """A positional candidate as named fields (``TUPLE_FIELDS``): attention_softmax_dropout_value's
  split 0 is ``"auto"``, qk_scale_softmax's block_k 0 the whole row (``WHOLE_ROW``)."""
  fields = TUPLE_FIELDS[op]
  if not 4 <= len(values) <= len(fields):
    raise ValueError(f"candidate {tuple(values)}: expected 4 to {len(fields)} values "
                     f"({', '.join(fields)})")
  entry = dict(zip(fields, values))
  if op == ATTENTION and entry.get("split") == 0:
    entry["split"] = AUTO
  if op == QK and entry["block_k"] == 0:
    entry["block_k"] = qks.WHOLE_ROW
  return entry


def parse_cands(op: str, text: str) -> dict[str, list[dict]]:
  """``--cands``: ``"ds=[(64,64,4,2),(64,64,4,2,True)];dv=[...]"`` -> ``{pass: [entry]}``.

  A candidate is a tuple in ``TUPLE_FIELDS[op]`` order (:func:`from_tuple`) or a dict of
  named fields; each is validated (``ValueError`` naming the field)."""
  result = {}
  for item in text.split(";"):
    if not item.strip():
      continue
    name, _, value = item.partition("=")
    name = name.strip()
    if name not in CANDIDATES[op]:
      raise ValueError(f"--cands: {op} has no pass {name!r}; expected one of "
                       f"{sorted(CANDIDATES[op])}")
    values = ast.literal_eval(value.strip())
    if isinstance(values, dict) or (isinstance(values, tuple) and values
                                    and not isinstance(values[0], (tuple, list, dict))):
      values = [values]  # one candidate
    entries = [dict(v) if isinstance(v, dict) else from_tuple(op, v) for v in values]
    for entry in entries:
      PASS_ENTRY[op](entry)
    result[name] = entries
  return result


def _label(cand):
  """``64x128/4w/2s`` plus the fields that differ from their defaults (``"table"``: the
  two-pass baseline)."""
  if isinstance(cand, str):
    return cand
  e = dict(cand)
  if "rows" in e:  # a dL kernel's launch
    return f"dl {e['rows']}r/{e['num_warps']}w" + ("/phased" if e.get("phased") else "")
  label = f"{e['block_q']}x{e['block_k']}/{e['num_warps']}w/{e['num_stages']}s"
  for name, value in list(e.items())[4:]:
    label += f"/{name}" if value is True else f"/{name}={value}"
  return label


# ----------------------------------------------------------------------- the passes


def _attention_passes(w, constants, sets, cands=None):
  """``{pass: (candidates, [fn(*set) per candidate], sets)}`` of
  attention_softmax_dropout_value."""
  cands = cands or CANDIDATES[ATTENTION]
  p = constants["attention_dropout"]
  h = constants["num_attention_heads"]
  b, _, kvh, sq, skv, d = bench._attention_dims(w, constants)

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
  dropout = Dropout.of(p)

  def keyed(entries):
    return [(candidate_key(ATTENTION, e), pass_config(ATTENTION, e, sq, skv))
            for e in entries]

  dv = [(c, lambda d_o, pd3, v3, cfg=cfg: asdv.dv_pass(d_o, pd3, v3, num_heads=h, cfg=cfg,
                                                       interpret=False))
        for c, cfg in keyed(cands["dv"])]
  ds = [(c, lambda d_o, p3, k3, v3, dpart, cfg=cfg: asdv.ds_pass(
      d_o, p3, k3, v3, dpart, None, num_heads=h, dropout=dropout, cfg=cfg, interpret=False))
        for c, cfg in keyed(cands["ds"])]
  return {"dv": (dv, dv_sets), "ds": (ds, ds_sets)}, asdv.length_class(skv)


def _qk_passes(w, constants, sets, cands=None):
  cands = cands or CANDIDATES[QK]
  b, h, sq, sk, d = bench._qk_dims(w, constants)
  scale = jnp.asarray([constants["scaling"]], jnp.float32)
  pk = max(16, pl.next_power_of_2(sk))

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

  def keyed(entries):
    return [(candidate_key(QK, e), pass_config(QK, e, sq, sk)) for e in entries]

  row_cands = [c for c in cands["row"] if c["block_k"] != qks.WHOLE_ROW or pk <= 512]
  row = [(c, lambda g, p, k, cfg=cfg: qks.row_pass(
      scale, g, p, k, causal=False, cfg=cfg, interpret=False)) for c, cfg in keyed(row_cands)]
  col = [(c, lambda g, p, q, delta, cfg=cfg: qks.col_pass(
      scale, g, p, q, delta, causal=False, cfg=cfg, interpret=False))
         for c, cfg in keyed(cands["col"])]
  passes = {"row": (row, row_sets), "col": (col, col_sets)}
  # The whole backward with the table's two-pass config: the baseline the schemes must beat.
  passes["two_pass"] = ([("table", lambda g, p, q, k: qks.qk_scale_softmax_backward(
      g[None], q[None], k[None], p[None], constants["scaling"], causal=False, config=base,
      interpret=False))], [(g, p, q, k) for g, p, q, k in view_sets])
  if pk <= 256:
    head = [(c, lambda g, p, q, k, cfg=cfg: qks.head_pass(
        scale, g, p, q, k, causal=False, cfg=cfg, interpret=False))
            for c, cfg in keyed(cands["head"])]
    passes["head"] = (head, [(g, p, q, k) for g, p, q, k in view_sets])
  if sk <= qks.MAX_DL_ROW:
    passes["dl"] = (_dl_candidates(base, sk, constants["scaling"]),
                    [(g, p, q, k) for g, p, q, k in view_sets])
  return passes, qks.length_class(sk)


def _dl_candidates(base, seq_k, scaling):
  """``[(key, fn)]``: the whole backward on the ``dl_gemm`` scheme, one per distinct dL
  launch of :data:`QK_DL` at this row length (``dl_config`` caps rows and warps)."""
  out, seen = [], set()
  for entry in QK_DL:
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


# Per scheme of qk_scale_softmax, the passes whose times add up to one backward.
QK_SCHEMES = {"two_pass": ("two_pass",), "per_head": ("head",), "dl_gemm": ("dl",)}


OPS = {
    ATTENTION: (bench.PROBLEM_ATTENTION, ATTENTION_WORKLOADS, _attention_passes),
    QK: (bench.PROBLEMS[QK], QK_WORKLOADS, _qk_passes),
}


# ----------------------------------------------------------------------- the table


def attention_table_entry(entry: dict) -> dict:
  """A class's entry of attention_softmax_dropout_value's table as ``default_config`` reads it
  (``Config.from_json(...).to_json()``); raises if it is not one."""
  return asdv.Config.from_json(entry).to_json()


def qk_table_entry(entry: dict) -> dict:
  """A class's entry of qk_scale_softmax's table (``scheme``, ``row``, ``col`` and, if measured,
  ``head``; ``dl`` and ``causal_dl``, the dL kernel's launch for dense and causal calls, kept
  as they are) as ``default_config`` reads it; raises if it is not one."""
  scheme = entry.get("scheme", "two_pass")
  if scheme not in qks.SCHEMES:
    raise ValueError(f"scheme: expected one of {qks.SCHEMES}, got {scheme!r}")
  out = {"scheme": scheme}
  for name in ("row", "col", "head"):
    if name in entry:
      out[name] = qk_pass_entry(entry[name])
    elif name != "head":
      raise KeyError(f"no {name!r} pass")
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


def select(ratios, best_times=None) -> tuple[dict, dict]:
  """ratios[class][pass] = list of {candidate: time / best} dicts, one per workload;
  best_times[class][pass] = that pass's best time per workload (qk_scale_softmax: picks the scheme).
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
      best, score = best_by_geomean(per_workload)
      if best is None:
        continue
      entry[name] = dict(best)
      note[f"{name}_geomean_vs_best"] = score
    if entry:
      table[key], notes[key] = entry, note
  return table, notes


def _write_table(op, ratios, out, best_times=None, device_kind=None):
  """Writes the selected entries (configs only; the passes of a class not measured in this
  run, and the classes not measured, keep their entries from the table already at
  ``out``) and prints the notes."""
  table, notes = select(ratios, best_times)
  if op == QK:  # a dl_gemm class whose dL launch this run did not time keeps its scheme
    old = read_table(out, device_kind or jax.devices()[0].device_kind)
    for key in table:
      if (old.get(key, {}).get("scheme") == "dl_gemm" and "scheme" in table[key]
          and "dl" not in ratios.get(key, {})):
        table[key].pop("scheme")
        notes[key]["scheme"] = "dl_gemm kept from the table (dl not timed in this run)"
  for key in table:
    print(f"  selected {key}: " + "  ".join(
        f"{name}={_label(tuple(v.items())) if isinstance(v, dict) else v}"
        for name, v in table[key].items()) + f"  {json.dumps(notes[key])}", flush=True)
  return write_table(table, out, entry_json=TABLE_ENTRY[op], merge=True, per_field=True,
                     device_kind=device_kind)


def check_candidates(op: str, cands: dict) -> None:
  """Builds every candidate's config (``ValueError`` naming a bad field)."""
  for entries in cands.values():
    for entry in entries:
      PASS_ENTRY[op](entry)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--op", required=True, choices=sorted(OPS))
  parser.add_argument("--out", default=None,
                      help="default: pallas_kernels/tuned/<this device>/<op>.json")
  parser.add_argument("--calls", type=int, default=8)
  parser.add_argument("--passes", default=None,
                      help="comma-separated passes to tune (default: all of the op's)")
  parser.add_argument("--workloads", default=None,
                      help="comma-separated workload indices (default: a fixed spread)")
  parser.add_argument("--cands", default=None,
                      help="replace candidate lists, e.g. "
                           "'ds=[(64,64,4,2),(64,64,4,2,True)];dv=[...]' (tuples in TUPLE_FIELDS "
                           "order: attention_softmax_dropout_value (block_q, block_k, num_warps, "
                           "num_stages, split, heads, row_align), split 0 = auto; "
                           "qk_scale_softmax (block_q, block_k, num_warps, num_stages, "
                           "row_align), block_k 0 = whole row; or dicts of named fields)")
  args = parser.parse_args(argv)
  cands = dict(CANDIDATES[args.op])
  if args.cands:
    cands.update(parse_cands(args.op, args.cands))
  check_candidates(args.op, cands)
  if no_gpu("tuning"):
    return 2
  problem, indices, passes_fn = OPS[args.op]
  device_kind = jax.devices()[0].device_kind
  out = args.out or _tuning.table_path(args.op, device_kind)
  if args.workloads:
    indices = [int(i) for i in args.workloads.split(",")]
  spec = workloads_spec()[problem.name + "_backward"]
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
    passes, key = passes_fn(w, constants, sets, cands)
    line = [f"{problem.label(w):>18} [{key}]"]
    for name, (pass_cands, pass_sets) in passes.items():
      if args.passes and name not in args.passes.split(","):
        continue
      compiled = compile_all([fn for _, fn in pass_cands], pass_sets[0])
      ok = []
      for (cand, _), exe in zip(pass_cands, compiled):
        if exe is None:
          continue
        try:
          jax.block_until_ready(exe(*pass_sets[0]))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory at launch
          print(f"  {name} {_label(cand)}: launch failed: {str(e).splitlines()[0][:160]}",
                flush=True)
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
      line.append(f"{name}: " + " ".join(f"{_label(c)}={t:.1f}" for (c, _), t in zip(ok, times)))
    print("  ".join(line), flush=True)
    result = _write_table(args.op, ratios, out, best_times if args.op == QK else None,
                          device_kind)
  print(json.dumps(result, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
