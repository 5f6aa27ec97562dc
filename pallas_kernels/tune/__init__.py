"""Tunes the kernels' launch configurations on this machine's GPU and writes the tables.

Usage::

    python -m pallas_kernels.tune                       # every kernel, the benchmark workloads
    python -m pallas_kernels.tune --quick               # a few minutes per kernel
    python -m pallas_kernels.tune --op qk_scale_softmax --shape 8,32,1024,1024,128
    python -m pallas_kernels.tune --write-package       # the package's shipped tables

For each kernel (``--op``, repeatable; default all three) and each workload (default: the
spec's benchmark workloads, ``pallas_kernels/workloads.json``, a spread of them for the
two-pass kernels, and a shape for each class of the shipped tables that no spec workload
has, :func:`default_workloads`; ``--shape``, repeatable, with one ``--op``: the shapes named, see
:data:`SHAPE_HELP`) it times the candidate configurations of each of the kernel's passes on
input sets rotated so that L2 is cold (:mod:`pallas_kernels._timing`). Per row-length class
it keeps the candidate with the best geomean of time / best time over the class's workloads.
Then, with that table written, it times the op's forward and backward as a training step
runs them (``implementation="pallas"`` against ``"xla"``, :func:`common.time_op`): a class
where XLA's is faster (geomean above 1) gets ``"backend": "xla"``, and
``implementation=None`` of the op runs XLA there (each op's ``config.runs_xla``). The
entry points still run the kernels. ``--quick`` times fewer candidates and one workload per
class. (``--write-package`` times the op with the package's tables, so run it with no user
cache for the device.)

The table is written after every workload (a run cut short keeps what it measured) and
merged into the one already there (the classes not measured keep their entries): by default
in the user cache, ``<cache>/<jax version>/<device folder>/<kernel>.json``
(``pallas_kernels._tuning.cache_dir``: ``$PALLAS_KERNELS_CACHE_DIR``, else
``$XDG_CACHE_HOME/pallas_kernels``, else ``~/.cache/pallas_kernels``), which later calls of
the same jax on the same device kind read ahead of the package's tables; with
``--write-package``, the package's table ``pallas_kernels/tuned/<device folder>/<kernel>.json``.
A progress bar with an estimate of the time left goes to stderr, the times per workload to
stdout. Without a CUDA GPU it exits 2.
"""

from __future__ import annotations

import argparse

import jax

from pallas_kernels import _tuning
from pallas_kernels import workloads as wl
from pallas_kernels._timing import no_gpu
from pallas_kernels._util import first_paragraph
from pallas_kernels.tune import attention, attention_run, common, masked

OPS = wl.OPS
SHAPE_HELP = {masked.OP: masked.SHAPE_HELP, **attention.SHAPE_HELP}
CALLS = {masked.OP: 10, attention.ATTENTION: 8, attention.QK: 8}
QUICK_CALLS = 5
# Shapes a default run adds for row-length classes that no spec workload has and the shipped
# tables hold (``--shape`` tuples of :data:`SHAPE_HELP`): masked_softmax_dropout's rows of
# 1024 keys (the training step's shape).
EXTRA_SHAPES = {masked.OP: ("8,16,1024,0.1",)}
EXTRA_INDEX = 200  # the PRNG index of the first extra shape (--shape takes 100 on)


def parse_shape(op: str, text: str) -> tuple[dict, dict]:
  """``(constants, workload)`` of a ``--shape`` of ``op`` (:data:`SHAPE_HELP`)."""
  values = tuple(v.strip() for v in text.split(",") if v.strip())
  if op == masked.OP:
    return masked.from_shape(values)
  return attention_run.from_shape(op, values)


def default_workloads(op: str, quick: bool) -> list[tuple[dict, dict, int]]:
  """``(constants, workload, index)`` of the workloads a run times: of the spec's, the masked
  kernel's 16 and the two-pass kernels' spread (``attention.WORKLOADS``), then the shapes of
  :data:`EXTRA_SHAPES` (indices from :data:`EXTRA_INDEX`), so that every row-length class the
  shipped tables hold is measured. ``quick``: one per class, the one of the most bytes (the
  small ones are bound by launch latency, and say little of a config)."""
  constants, workloads = wl.problem(op)
  indices = masked.WORKLOADS if op == masked.OP else attention.WORKLOADS[op]
  plan = [(constants, workloads[i], i) for i in indices]
  plan += [(*parse_shape(op, shape), EXTRA_INDEX + j)
           for j, shape in enumerate(EXTRA_SHAPES.get(op, ()))]
  if not quick:
    return plan
  largest = {}
  for c, w, i in plan:
    key, size = length_class(op, c, w), wl.floor_bytes(op, w, c)
    if key not in largest or size > largest[key][0]:
      largest[key] = (size, i)
  keep = {i for _, i in largest.values()}
  return [(c, w, i) for c, w, i in plan if i in keep]


def length_class(op: str, constants: dict, w: dict) -> str:
  if op == masked.OP:
    return masked.length_class(constants, w)
  return attention_run.length_class(op, constants, w)


def run_workload(op, constants, w, index, measure, **options) -> dict:
  if op == masked.OP:
    return masked.run_workload(constants, w, index, measure, **options)
  return attention_run.run_workload(op, constants, w, index, measure, **options)


def write(op, records, out, device_kind, show=None) -> dict:
  if op == masked.OP:
    return masked.write(records, out, device_kind, show)
  return attention_run.write(op, records, out, device_kind, show)


def out_path(op: str, device_kind: str, package: bool) -> str:
  """Where a run writes ``op``'s table: the user cache, or (``package``) the package."""
  if package:
    return _tuning.table_path(op, device_kind)
  return _tuning.user_table_path(op, device_kind)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m pallas_kernels.tune", description=first_paragraph(__doc__),
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="--shape tuples:\n  " + "\n  ".join(SHAPE_HELP[op] for op in OPS))
  p.add_argument("--op", action="append", choices=OPS,
                 help="kernel(s) to tune (repeatable); default: all three")
  p.add_argument("--shape", action="append", default=[],
                 help="a shape to tune for instead of the benchmark workloads (repeatable; "
                      "needs one --op); the tuple per op is below")
  p.add_argument("--quick", action="store_true",
                 help="fewer candidates, one workload per row-length class, fewer calls")
  p.add_argument("--write-package", action="store_true",
                 help="write the package's shipped table (pallas_kernels/tuned/<device>/) "
                      "instead of the user cache")
  p.add_argument("--calls", type=int, default=None, help="timed calls per candidate")
  p.add_argument("--passes", default=None,
                 help="comma-separated passes to tune (one --op; default: all of its)")
  p.add_argument("--cands", default=None,
                 help="replace candidate lists of one two-pass --op, e.g. "
                      "'ds=[(64,64,4,2),(64,64,4,2,0,2)];dv=[...]' (tuples in "
                      "pallas_kernels.tune.attention.TUPLE_FIELDS order, or dicts of fields)")
  return p


def main(argv=None, *, measure: common.Measure | None = None, stream=None) -> int:
  """The command line. ``measure`` replaces the device timing
  (:func:`common.device_measure`; then no GPU is needed) and ``stream`` the progress
  bar's stderr."""
  p = parser()
  args = p.parse_args(argv)
  ops = list(dict.fromkeys(args.op or OPS))
  if (args.shape or args.passes or args.cands) and len(ops) != 1:
    p.error("--shape, --passes and --cands need exactly one --op")
  cands = None
  try:
    shapes = [parse_shape(ops[0], s) for s in args.shape]
    if args.cands:
      if ops[0] == masked.OP:
        raise ValueError(f"--cands: {masked.OP} takes none")
      cands = attention.parse_cands(ops[0], args.cands)
      attention.check_candidates(ops[0], cands)
  except ValueError as e:
    p.error(str(e))
  if measure is None:
    if no_gpu("tuning", "the tests run the tuner with a fake timer instead"):
      return 2
    measure = common.device_measure
  device = jax.devices()[0]
  device_kind = device.device_kind
  table_kind = _tuning.table_kind(device)
  plan = []
  for op in ops:
    if shapes:
      plan += [(op, c, w, 100 + i) for i, (c, w) in enumerate(shapes)]
    else:
      plan += [(op, c, w, i) for c, w, i in default_workloads(op, args.quick)]
  passes = args.passes.split(",") if args.passes else None
  progress = common.Progress(len(plan), stream=stream)
  print(f"tuning on {device_kind}, jax {jax.__version__}: {len(plan)} workloads of "
        f"{', '.join(ops)}; tables go to "
        + ("the package" if args.write_package else _tuning.cache_dir()), flush=True)
  # Each class's table entry as the run found it: a candidate on every workload of the class,
  # though the run rewrites the entry after the class's first workload.
  served = {op: dict(_tuning.table(op, table_kind)) for op in ops}
  records: dict[str, dict[str, list]] = {op: {} for op in ops}
  written = {}
  progress.show(f"{plan[0][0]} {wl.label(plan[0][0], plan[0][2])}" if plan else "")
  for op, c, w, index in plan:
    calls = args.calls or (QUICK_CALLS if args.quick else CALLS[op])
    record = run_workload(op, c, w, index, measure, quick=args.quick, calls=calls,
                          cands=cands, passes=passes, device_kind=table_kind,
                          served=served[op])
    records[op].setdefault(record["key"], []).append(record)
    out = out_path(op, device_kind, args.write_package)
    write(op, records[op], out, device_kind, show=set())
    # The op's step with the table just written, against XLA's: the class's backend.
    record["xla"], record["pallas"] = common.time_op(op, c, w, index, measure,
                                                     key=record["key"], calls=calls)
    written[op] = (out, write(op, records[op], out, device_kind, show={record["key"]}))
    table_kind = _tuning.table_kind(device)
    progress.advance(f"{op} {wl.label(op, w)} [{record['key']}]")
  progress.close()
  for op, (out, result) in written.items():
    xla = [k for k, e in result["configs"].items() if e.get("backend") == common.XLA]
    print(f"{op}: {out} ({len(result['configs'])} classes"
          + (f"; XLA's backward for {', '.join(xla)}" if xla else "") + ")")
  return 0
