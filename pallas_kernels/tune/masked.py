"""The masked_softmax_dropout tuner: one kernel, configs by elements per program and warps.

For a workload it times every candidate :class:`TableEntry` (``target`` elements per
program and ``num_warps``, each with ``split`` on and off, and each again with the cache
fields of the tables' entry for the class; entries that make the same :class:`Config` are
timed once, and a config of over 64 elements per thread and array, which spills, is not
timed) and the entry the device's tables held for the workload's class when the run began,
each as the kernel entry point launches it and as the op's backward does (the variant that
recomputes P from the scores: one entry serves both). Per row-length class
(``length_class(Sk)``) the table keeps the candidate with the best geomean of time / best
time over the class's workloads and both launches, among those at most
``common.KEEP_SLACK`` slower than that entry on each of them; its entry is a
``TableEntry``'s JSON (``target``, ``num_warps``, ``split`` and the fields that differ from
their defaults).
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels import masked_softmax_dropout as msd
from pallas_kernels.masked_softmax_dropout import pallas_triton as msd_triton
from pallas_kernels import workloads as wl
from pallas_kernels.masked_softmax_dropout.config import KERNEL
from pallas_kernels.tune import common

OP = KERNEL
PASS = "kernel"  # the kernel entry point's launch
OP_PASS = "op"   # the same entry's launch of the op's backward (from the scores)
# TableEntry fields (each is timed with split=True and split=False): 4 to 32 elements per
# thread and array.
CANDIDATES = [
    dict(target=512, num_warps=1), dict(target=512, num_warps=2), dict(target=512, num_warps=4),
    dict(target=1024, num_warps=1), dict(target=1024, num_warps=2),
    dict(target=1024, num_warps=4), dict(target=1024, num_warps=8),
    dict(target=2048, num_warps=2), dict(target=2048, num_warps=4),
    dict(target=2048, num_warps=8),
    dict(target=4096, num_warps=4), dict(target=4096, num_warps=8),
    dict(target=4096, num_warps=16),
    dict(target=8192, num_warps=8), dict(target=8192, num_warps=16),
]
# --quick: these of CANDIDATES.
QUICK = [3, 4, 6, 8, 11, 14]
WORKLOADS = tuple(range(16))  # the spec's workloads that the default run times
SHAPE = "B,H,S[,P]"
SHAPE_HELP = ("masked_softmax_dropout: B,H,S[,P] (scores [B, H, S, S] fp32, mask "
              "[B, 1, S, S]; P the dropout rate, default 0.1)")


def entry_json(entry: dict) -> dict:
  """A class's entry as the kernel reads it (``TableEntry``'s JSON); ``ValueError`` (or
  ``KeyError``/``TypeError``) if it is not one."""
  return msd.TableEntry.from_json(entry).to_json()


def length_class(constants: dict, workload: dict) -> str:
  return msd.length_class(workload["seq_len"])


def from_shape(values: tuple) -> tuple[dict, dict]:
  """``(constants, workload)`` of a ``B,H,S[,P]`` shape."""
  if len(values) not in (3, 4):
    raise ValueError(f"--shape for {OP}: expected {SHAPE}, got {','.join(map(str, values))}")
  b, h, s = (int(v) for v in values[:3])
  p = float(values[3]) if len(values) == 4 else 0.1
  constants, _ = wl.problem(OP)
  return dict(constants), {"batch_size": b, "n_heads": h, "seq_len": s, "p_dropout": p,
                           "atol": 1e-5, "rtol": 1e-5}


def candidates(quick: bool, served: dict, seq_k: int) -> list[msd.TableEntry]:
  """The entries timed for rows of ``seq_k``: the candidates (``quick``: :data:`QUICK`'s)
  with split on and off, the same with the cache and eviction fields of the entry of
  ``served`` for the class (where it has any), then that entry where it is not among them.
  ``served``: ``{class: entry}``, the device's table as the run found it (a class's entry
  stays the same over its workloads while the run rewrites it)."""
  base = [CANDIDATES[i] for i in QUICK] if quick else CANDIDATES
  out = [msd.TableEntry(**c, split=s) for c in base for s in (True, False)]
  current = msd.table_entry(served, seq_k)
  if current is not None and current.variant:
    out += [dataclasses.replace(e, variant=current.variant) for e in list(out)]
  if current is not None and current not in out:
    out.append(current)
  return out


def run_workload(constants, w, index, measure, *, quick=False, calls=10, cands=None,
                 passes=None, device_kind=None, served=None) -> dict:
  """Times a workload's candidates twice: as the kernel entry point runs them (pass
  ``"kernel"``, P and the keep mask read) and as the op's backward does (pass ``"op"``: the
  variant that recomputes P from the scores and draws keep from a key). A record ``{"key":
  class, "times": {pass: {TableEntry: us}}, "served": entry}`` (the op's times against XLA's,
  ``"xla"`` and ``"pallas"``, come later: :func:`pallas_kernels.tune.common.time_op`).
  ``served``: the device's table as the run found it (:func:`candidates`)."""
  del cands, passes, device_kind
  sq = sk = w["seq_len"]
  key = msd.length_class(sk)
  make_sets = common.lazy_sets(OP, constants, w, index)
  by_config: dict = {}
  for entry in candidates(quick, served or {}, sk):
    config = entry.config(sq, sk)
    width = sum(c for _, c in msd.column_chunks(sk, config.split))
    if config.block_rows * width > 64 * 32 * entry.num_warps:
      continue  # over 64 elements per thread and array: spills
    by_config.setdefault(config, []).append(entry)
  p = w["p_dropout"]
  rng = jax.random.key(index)
  variants = {
      PASS: lambda c: lambda g, pr, m, k: msd.masked_softmax_dropout_backward(
          g, pr, m, k, p, config=c),
      # The inputs' P stands in for the scores (any finite rows), keep for nothing.
      OP_PASS: lambda c: lambda g, pr, m, k: msd_triton.masked_softmax_dropout_backward_from_scores(
          g, pr, m, rng, p, config=c),
  }
  times = {}
  for name, make_fn in variants.items():
    fns = [(config, make_fn(config)) for config in by_config]
    trial = common.Trial(OP, key, name, constants, w)
    by_time = measure(trial, fns, make_sets, calls=calls)
    times[name] = {e: t for config, t in by_time.items() for e in by_config[config]}
    if by_time:
      best = min(by_time.values())
      print(f"{wl.label(OP, w):>22} [{key}] {name:>6}  best {best:8.1f} us  " + "  ".join(
                f"{common.label(by_config[c][0])}:{t:.1f}"
                for c, t in by_time.items()), flush=True)
  return {"key": key, "times": times, "served": msd.table_entry(served or {}, sk)}


def select(by_class: dict[str, list[dict]], served: dict | None = None) -> tuple[dict, dict]:
  """Per length class, the candidate (a ``TableEntry``) with the best geomean of time /
  best time, among those within ``common.KEEP_SLACK`` of the class's ``served[class]`` on
  each workload (:func:`common.best_by_geomean`): ``({class: entry JSON},
  {class: geomean_vs_best})``."""
  table, notes = {}, {}
  for key, ratios in sorted(by_class.items()):
    best, score = common.best_by_geomean(ratios, keep=(served or {}).get(key))
    if best is not None:
      table[key], notes[key] = best.to_json(), score
  return table, notes


def _write_table(by_class: dict[str, list[dict]], out: str, device_kind=None,
                 backends: dict | None = None, show=None, served=None) -> dict:
  """Writes the selected entries (configs only, and ``backends[class]`` where given) merged
  into the table at ``out`` (a run cut short keeps the classes it did not reach), and
  prints their notes (of the classes in ``show``; default all)."""
  table, notes = select(by_class, served)
  for key, backend in (backends or {}).items():
    if key in table and backend is not None:
      table[key]["backend"] = backend
  print("  selected: " + "  ".join(
      f"{k}: {common.label(tuple(e.items()))}{' (xla)' if e.get('backend') == 'xla' else ''} "
      f"(geomean_vs_best {notes[k]})" for k, e in table.items() if show is None or k in show),
      flush=True)
  return common.write_table(table, out, entry_json=entry_json, merge=True,
                            device_kind=device_kind)


def write(records: dict[str, list[dict]], out: str, device_kind: str, show=None) -> dict:
  """Selects per class from the workloads' records, decides the backend where the records
  hold the op's times (Pallas against XLA, :func:`common.choose_backend`) and writes the
  table. A class whose op runs XLA is selected again on the entry point's launch alone."""
  def ratios(rs, names=(PASS, OP_PASS)):
    return [common.ratios_of(r["times"][name]) for r in rs for name in names
            if r["times"].get(name)]
  by_class = {k: v for k, rs in records.items() if (v := ratios(rs))}
  served = common.served_of(records)
  backends = {}
  selected, _ = select(by_class, served)
  for key, rs in records.items():
    if key not in selected:
      continue
    backends[key], score = common.choose_backend([r.get("pallas") for r in rs],
                                                 [r.get("xla") for r in rs])
    if score is not None and (show is None or key in show):
      print(f"  {key}: op Pallas / XLA geomean {score} -> {backends[key]}", flush=True)
    if backends[key] == common.XLA and (kernel_only := ratios(rs, (PASS,))):
      by_class[key] = kernel_only   # the op runs XLA there: the entry serves the entry point
  return _write_table(by_class, out, device_kind, backends, show, served)
