"""The tuners of the two-pass kernels: attention_softmax_dropout_value and qk_scale_softmax.

Each kernel runs as two Pallas calls (attention_softmax_dropout_value: dV + delta, then dS;
qk_scale_softmax: delta + grad_query, then grad_key); they are timed apart, each over a list
of candidate tiles and launch parameters plus the entry the device's tables hold for the
class. Per length class (``length_class``) the table keeps, per pass, the candidate with the
best geomean of time / best time over the class's workloads, among those at most
``common.KEEP_SLACK`` slower than the tables' entry on each of them; the passes a run does
not time (``--passes``) keep their entries.

A class's entry holds configs only, with named fields, as the op's ``default_config`` reads
them (attention_softmax_dropout_value: ``Config.to_json()``, ``{"dv": {...}, "ds": {...}}``;
qk_scale_softmax: ``{"scheme": ..., "row": {...}, "col": {...}, "head": {...}}`` of
``qk_scale_softmax.table_entry``).

A candidate is a pass's table entry: its ``PassConfig`` fields by name (fields left out take
their defaults; qk_scale_softmax's ``"block_k": "row"`` (``WHOLE_ROW``) is a whole padded row
as one tile). ``--cands`` replaces the lists for one run; it takes positional tuples
(:data:`TUPLE_FIELDS`; attention_softmax_dropout_value: ``(block_q, block_k, num_warps,
num_stages[, split, heads, row_align])``, split 0 = ``"auto"``; qk_scale_softmax:
``(block_q, block_k, num_warps, num_stages[, row_align])``, block_k 0 = the whole row) or
dicts of named fields.

Each op's fused forward is a pass too (``fwd``: :data:`ATTENTION_FWD`, :data:`QK_FWD`),
timed alone where the op's forward runs that kernel, writing what the op's forward writes;
its entry in the table is read by the forward's ``forward_config``. A class's entry needs its
backward passes too: ``--passes fwd`` on a class the table lacks writes nothing for it.

attention_softmax_dropout_value's pass 1 is timed with delta's partials. Where the dS pass
takes a whole row in one tile it needs none, and pass 1 then runs without its dPd GEMM; the
tuner does not time that pairing: re-tuning a class of one-tile dS rows replaces its entry
with a two-pass one.

For qk_scale_softmax the tuner also times the whole backward with the table's two-pass
config, for rows of <= 256 keys the one-kernel ``per_head`` scheme (pass ``head``), and the
``dl_gemm`` scheme over the dL kernel's launches (pass ``dl``, :data:`QK_DL`); the table's
``scheme`` for a class is the one with the best geomean over its workloads. The causal dL
launch (``causal_dl``) is not timed: a class keeps the one its table has, else takes the one
of the table that served the device. The forward's
entry serves dense and causal calls alike.
"""

from __future__ import annotations

import ast
import dataclasses

from pallas_kernels import attention_softmax_dropout_value as asdv
from pallas_kernels import qk_scale_softmax as qks
from pallas_kernels import _tuning
from pallas_kernels.attention_softmax_dropout_value.config import AUTO

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
# Explicit larger splits: small ragged launches run one partial wave of large programs.
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
ATTENTION_WORKLOADS = (0, 1, 2, 3, 4, 5, 8, 10, 15)  # the spec's workloads the default run times

# qk_scale_softmax: candidates of each kernel (qks.PassConfig fields); block_k WHOLE_ROW ("row")
# is the whole padded row as one tile (row kernel: timed only on rows of <= 512 keys).
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
QK_WORKLOADS = (0, 1, 2, 4, 8, 9, 10, 13, 14)  # the spec's workloads the default run times
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

# attention_softmax_dropout_value's fused forward (``TritonPassConfig`` fields), timed as the
# op's forward calls it where it runs the fused kernel (its residual policy). The default first.
ATTENTION_FWD = [
    dict(block_q=32, block_k=64, num_warps=4, num_stages=3),
    dict(block_q=64, block_k=64, num_warps=4, num_stages=3),
    dict(block_q=32, block_k=128, num_warps=4, num_stages=2),
    dict(block_q=64, block_k=128, num_warps=8, num_stages=2),
    dict(block_q=16, block_k=64, num_warps=4, num_stages=3),
    dict(block_q=32, block_k=64, num_warps=4, num_stages=2),
    dict(block_q=64, block_k=64, num_warps=8, num_stages=3),
    dict(block_q=32, block_k=128, num_warps=8, num_stages=3),
    dict(block_q=16, block_k=128, num_warps=4, num_stages=3),
    dict(block_q=64, block_k=32, num_warps=4, num_stages=3),
]

# qk_scale_softmax's Triton forward (``ForwardConfig`` fields; key tiles of at most 256), timed
# where the op's forward runs it (not where the Mosaic GPU forward takes the rows). First the
# defaults of rows of 129-256 keys (one tile) and of longer rows (128 x 64 on 8 warps); the
# third is the default of rows of <= 128 keys.
QK_FWD = [
    dict(block_q=64, block_k=256, num_warps=8, num_stages=2),
    dict(block_q=128, block_k=64, num_warps=8, num_stages=3),
    dict(block_q=64, block_k=128, num_warps=4, num_stages=2),
    dict(block_q=128, block_k=128, num_warps=8, num_stages=2),
    dict(block_q=64, block_k=64, num_warps=4, num_stages=3),
    dict(block_q=128, block_k=64, num_warps=8, num_stages=2),
    dict(block_q=64, block_k=128, num_warps=8, num_stages=3),
    dict(block_q=128, block_k=128, num_warps=8, num_stages=3),
    dict(block_q=128, block_k=32, num_warps=4, num_stages=3),
    dict(block_q=64, block_k=64, num_warps=4, num_stages=4),
    dict(block_q=32, block_k=128, num_warps=4, num_stages=2),
    dict(block_q=128, block_k=256, num_warps=8, num_stages=2),
]

# Candidate lists per op and pass (``--cands`` replaces them for one run).
CANDIDATES = {
    ATTENTION: {"dv": ATTENTION_DV, "ds": ATTENTION_DS, "fwd": ATTENTION_FWD},
    QK: {"row": QK_ROW, "col": QK_COL, "head": QK_HEAD, "fwd": QK_FWD},
}
# --quick: the first of each list (the lists open with the usual winners), and these dL
# launches.
QUICK = {ATTENTION: {"dv": 6, "ds": 6, "fwd": 5}, QK: {"row": 6, "col": 5, "head": 4, "fwd": 6}}
QUICK_DL = [dict(rows=r, num_warps=w) for r in (1, 2, 4) for w in (1, 4)] + [
    dict(rows=1, num_warps=1, phased=True)]
WORKLOADS = {ATTENTION: ATTENTION_WORKLOADS, QK: QK_WORKLOADS}

# The positional order of a ``--cands`` tuple.
TUPLE_FIELDS = {
    ATTENTION: ("block_q", "block_k", "num_warps", "num_stages", "split", "heads", "row_align"),
    QK: ("block_q", "block_k", "num_warps", "num_stages", "row_align"),
}
SHAPE = {ATTENTION: "B,H,KVH,Sq,Skv,D", QK: "B,H,Sq,Sk,D"}
SHAPE_HELP = {
    ATTENTION: ("attention_softmax_dropout_value: B,H,KVH,Sq,Skv,D (scores [B, H, Sq, Skv], "
                "value_states [B, KVH, Skv, D], bf16, the spec's dropout rate)"),
    QK: "qk_scale_softmax: B,H,Sq,Sk,D (query [B, H, Sq, D], key [B, H, Sk, D], bf16, scale D^-0.5)",
}


# ----------------------------------------------------------------------- candidates


def attention_pass_entry(entry: dict) -> dict:
  """A pass candidate of attention_softmax_dropout_value as the table holds it
  (``PassConfig.to_json``: the launch fields, then the others that differ from their
  defaults); raises ``ValueError`` naming a bad field."""
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


def dl_entry(entry: dict) -> dict:
  """A dL launch candidate (``rows``, ``num_warps``, ``phased``); raises on a bad value."""
  unknown = sorted(set(entry) - {"rows", "num_warps", "phased"})
  if unknown:
    raise ValueError(f"dl: unknown fields {unknown}; expected some of rows, num_warps, phased")
  qks.DlConfig(**entry)
  return dict(entry)


# The forward kernels' launch dataclasses (all four fields: tiles, warps, stages).
FORWARD_CONFIG = {ATTENTION: _tuning.TritonPassConfig, QK: qks.ForwardConfig}


def fwd_entry(op: str, entry: dict) -> dict:
  """A forward launch candidate of ``op`` (its :data:`FORWARD_CONFIG` fields, all four);
  raises ``ValueError`` naming a bad field."""
  names = [f.name for f in dataclasses.fields(FORWARD_CONFIG[op])]
  unknown = sorted(set(entry) - set(names))
  if unknown:
    raise ValueError(f"fwd: unknown fields {unknown}; expected some of {names}")
  config = FORWARD_CONFIG[op](**entry)
  return {name: getattr(config, name) for name in names}


PASS_ENTRY = {ATTENTION: attention_pass_entry, QK: qk_pass_entry}


def _pass_entry(op: str, name: str, entry: dict) -> dict:
  if name == "dl":
    return dl_entry(entry)
  return fwd_entry(op, entry) if name == "fwd" else PASS_ENTRY[op](entry)


def pass_config(op: str, entry: dict, seq_q: int, seq_k: int, name: str = ""):
  """The pass config a candidate runs with on a workload: tiles capped at the padded
  lengths (qk_scale_softmax: a whole-row tile is the padded row), as the op's
  ``default_config`` (pass ``"fwd"``: the forward's ``forward_config``) does."""
  if name == "fwd":
    return FORWARD_CONFIG[op](**entry).capped(seq_q, seq_k)
  if op == ATTENTION:
    return asdv.PassConfig.from_json(entry).capped(seq_q, seq_k)
  return qks.pass_config(entry, seq_q, seq_k)


def candidate_key(op: str, entry: dict, name: str = "") -> tuple:
  """A candidate of pass ``name`` as a hashable key (its table entry's items); ``dict(key)``
  is the entry."""
  return tuple(_pass_entry(op, name, entry).items())


def from_tuple(op: str, values) -> dict:
  """A positional candidate as named fields (:data:`TUPLE_FIELDS`): attention_softmax_dropout_value's
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
      _pass_entry(op, name, entry)
    result[name] = entries
  return result


def check_candidates(op: str, cands: dict) -> None:
  """Builds every candidate's config (``ValueError`` naming a bad field)."""
  for name, entries in cands.items():
    for entry in entries:
      _pass_entry(op, name, entry)


def candidates(op: str, quick: bool, cands: dict | None = None) -> dict[str, list[dict]]:
  """The candidate lists of ``op``'s passes (qk_scale_softmax: with ``"dl"``, the dL
  launches): ``cands``' where given, else the full lists or (``quick``) their first
  :data:`QUICK` and :data:`QUICK_DL`."""
  out = {name: list(entries) for name, entries in CANDIDATES[op].items()}
  if op == QK:
    out["dl"] = list(QK_DL)
  if quick:
    out = {name: entries[:QUICK[op].get(name, len(entries))] for name, entries in out.items()}
    if op == QK:
      out["dl"] = list(QUICK_DL)
  out.update(cands or {})
  return out


def served_keys(op: str, entry: dict) -> dict:
  """``{pass: candidate key}`` of a class's served table entry (``{}``: none), for each pass
  this tuner can time it in (the ``keep`` of :func:`common.best_by_geomean`)."""
  out = {}
  for name, fields in entry.items():
    if name == "dl" or not isinstance(fields, dict):
      continue
    try:
      out[name] = candidate_key(op, fields, name)
    except (KeyError, TypeError, ValueError):
      pass  # not a valid entry for this tuner: not timed
  return out


def _with_table(op: str, cands: dict, kept: dict) -> dict:
  """``cands`` plus, per pass, the served entry's candidate ``kept[pass]``
  (:func:`served_keys`) where it is not among them: no tuning run loses it."""
  out = {name: list(entries) for name, entries in cands.items()}
  for name, key in kept.items():
    if name in out and key not in {candidate_key(op, e, name) for e in out[name]}:
      out[name].append(dict(key))
  return out
