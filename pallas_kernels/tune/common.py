"""What the tuners share: the measurement (a timer that can be swapped for tests), the
progress bar, the per-class selection, the op's time against XLA's and the tables'
reading and writing.

A measurement is ``measure(trial, candidates, make_sets, *, calls) -> {key: time}``:
``candidates`` are ``(key, fn)`` pairs, ``make_sets()`` gives the input sets that the calls
rotate through (made only when a measurement needs them), and the result holds the median
device time of each candidate that compiled and launched (:func:`device_measure`). ``trial``
says what is measured: the op, the row-length class, the pass and the workload.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Callable

import jax

from pallas_kernels import _tuning
from pallas_kernels._timing import compile_all, device_times_us
from pallas_kernels import workloads as wl

XLA = "xla"        # a class whose XLA backward beats its kernels
PALLAS = "pallas"  # the default: the kernels
MAX_SETS = 16      # input sets per workload (together at least wl.ROTATE_BYTES)


@dataclasses.dataclass(frozen=True)
class Trial:
  """What one measurement times: ``op``'s pass ``name`` (``"xla"``: the op's forward and
  backward, XLA's against the kernels', :func:`time_op`) on workload ``workload`` of
  ``constants`` (``pallas_kernels.workloads``' dicts), of row-length class ``key``."""
  op: str
  key: str
  name: str
  constants: dict
  workload: dict


Measure = Callable[..., dict]


def device_measure(trial: Trial, candidates, make_sets, *, calls: int) -> dict:
  """Compiles every candidate ahead of time, launches each once (a candidate that fails to
  compile or launch is left out, with a message) and times the rest in one profiler trace
  (:func:`pallas_kernels._timing.device_times_us`, one untimed call each):
  ``{key: median microseconds}``."""
  sets = make_sets()
  compiled = compile_all([fn for _, fn in candidates], sets[0])
  ok = []
  for (key, _), exe in zip(candidates, compiled):
    if exe is None:
      continue
    try:
      jax.block_until_ready(exe(*sets[0]))
    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory at launch
      print(f"  {trial.name} {label(key)}: launch failed: {str(e).splitlines()[0][:160]}",
            flush=True)
      continue
    ok.append((key, exe))
  if not ok:
    return {}
  times = device_times_us([exe for _, exe in ok], sets, calls=calls, warmup=1)
  return {key: t["median_us"] for (key, _), t in zip(ok, times)}


def lazy_sets(op: str, constants: dict, workload: dict, index: int) -> Callable[[], list]:
  """``make_sets()`` of a workload: the entry point's positional arrays, 2 to
  :data:`MAX_SETS` sets (:func:`pallas_kernels.workloads.input_sets`), made on first call."""
  made = []

  def make():
    if not made:
      made.append(wl.input_sets(lambda k: wl.make_inputs(op, workload, constants, k), index,
                                MAX_SETS))
    return made[0]
  return make


def label(key) -> str:
  """A candidate key as text: ``64x128/4w/2s`` plus the fields that differ from their
  defaults; a dL launch ``dl 2r/4w``; a name (``"table"``, ``"xla"``) as it is."""
  if isinstance(key, str):
    return key
  if hasattr(key, "to_json"):
    key = tuple(key.to_json().items())
  e = dict(key)
  if "rows" in e:
    return f"dl {e['rows']}r/{e['num_warps']}w" + ("/phased" if e.get("phased") else "")
  if "target" in e:
    return f"{e['target']}/{e['num_warps']}w/{'s' if e['split'] else 'p'}"
  out = f"{e['block_q']}x{e['block_k']}/{e['num_warps']}w/{e['num_stages']}s"
  for name, value in list(e.items())[4:]:
    out += f"/{name}" if value is True else f"/{name}={value}"
  return out


# ----------------------------------------------------------------------- progress


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  if seconds >= 3600:
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
  if seconds >= 60:
    return f"{seconds // 60}m{seconds % 60:02d}s"
  return f"{seconds}s"


class Progress:
  """A progress bar in plain text: ``[#####.....] 3/12  25%  elapsed 1m02s  ETA 3m06s  what``.

  The estimate is the mean time of the steps done so far times the steps left. On a
  terminal the bar redraws one line; elsewhere (a log) each update is a line of its own.
  """

  def __init__(self, total: int, *, stream=None, clock=time.monotonic, width: int = 24):
    self.total, self.done, self.width = total, 0, width
    self.stream = stream if stream is not None else sys.stderr
    self.clock = clock
    self.start = clock()
    self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

  def text(self, what: str = "") -> str:
    filled = self.width * self.done // max(self.total, 1)
    elapsed = self.clock() - self.start
    eta = (_duration(elapsed / self.done * (self.total - self.done)) if self.done
           else "?")
    return (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
            f"{self.done / max(self.total, 1):4.0%}  elapsed {_duration(elapsed)}  ETA {eta}"
            + (f"  {what}" if what else ""))

  def show(self, what: str = "") -> None:
    line = self.text(what)
    if self.tty:
      self.stream.write("\r\033[K" + line)
    else:
      self.stream.write(line + "\n")
    self.stream.flush()

  def advance(self, what: str = "") -> None:
    self.done += 1
    self.show(what)

  def close(self) -> None:
    if self.tty:
      self.stream.write("\n")
      self.stream.flush()


# ----------------------------------------------------------------------- selection


def geomean(values) -> float:
  values = list(values)
  return math.exp(sum(math.log(v) for v in values) / len(values))


def ratios_of(times: dict) -> dict:
  """One workload's ``{candidate: time}`` as ``{candidate: time / best time}``."""
  best = min(times.values())
  return {k: t / best for k, t in times.items()}


def served_of(records: dict[str, list[dict]]) -> dict:
  """``{class: the entry that served it when the run began}``, as its workloads' records
  carry it (``"served"``, the same in each record of a class)."""
  return {k: rs[0].get("served") for k, rs in records.items() if rs}


# A candidate replaces the entry that served a class only if it is at most this much slower
# than that entry on every workload of the class: a run never trades one shape for another.
KEEP_SLACK = 0.01


def best_by_geomean(ratios: list[dict], keep=None):
  """The candidate with the best geomean of time / best time over the workloads, and it.
  ``keep``: the entry that served the class; where it ran on every workload, only the
  candidates within :data:`KEEP_SLACK` of it on each workload compete (it among them)."""
  common = set.intersection(*(set(r) for r in ratios)) if ratios else set()
  if not common:  # every candidate failed on some workload of the class
    print("no candidate ran on every workload of a class; its entry is left as it was")
    return None, None
  if keep in common:
    common = {c for c in common if all(r[c] <= r[keep] * (1 + KEEP_SLACK) for r in ratios)}
  score = {c: geomean(r[c] for r in ratios) for c in common}
  best = min(score, key=lambda c: (score[c], repr(c)))
  return best, round(score[best], 4)


def choose_backend(pallas: list, xla: list):
  """``(backend, geomean of Pallas time / XLA time)`` of a class from its workloads' op
  times (:func:`time_op`):
  :data:`XLA` where the geomean is above 1, else :data:`PALLAS`; ``(None, None)`` where a
  workload lacks either time."""
  if not pallas or any(t is None for t in (*pallas, *xla)) or len(pallas) != len(xla):
    return None, None
  score = geomean(p / x for p, x in zip(pallas, xla))
  return (XLA if score > 1 else PALLAS), round(score, 4)


# ----------------------------------------------------------------------- tables


def class_order(key: str):
  """Classes by length, the aligned one before the ragged one."""
  length, _, rest = key.partition("-")
  return (int(length), rest) if length.isdigit() else (math.inf, key)


def dumps(value, depth: int = 0) -> str:
  """JSON with one level per line down to a class's entry; the objects inside an entry
  (a pass's config) on one line each."""
  if not isinstance(value, dict) or not value or depth >= 3:
    return json.dumps(value)
  pad = " " * (depth + 1)
  items = [f"{pad}{json.dumps(k)}: {dumps(v, depth + 1)}" for k, v in value.items()]
  return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"


def read_table(path: str, device_kind: str) -> dict:
  """The configs of the table at ``path`` if it was measured on ``device_kind``, else ``{}``."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    old = json.load(f)
  return dict(old.get("configs", {})) if old.get("device_kind") == device_kind else {}


def compute_capability(device_kind: str) -> str | None:
  """The compute capability of this process's device of ``device_kind`` (a table records it:
  devices without tables of their own take those of their architecture)."""
  caps = {getattr(d, "compute_capability", None) for d in jax.devices()
          if d.device_kind == device_kind}
  return str(caps.pop()) if len(caps) == 1 and None not in caps else None


def _old_capability(path: str) -> str | None:
  try:
    with open(path) as f:
      return json.load(f).get("compute_capability")
  except (OSError, ValueError):
    return None


def with_backend(entry_json: Callable) -> Callable:
  """``entry_json`` of an entry that may carry ``"backend"``: the kernel fields as
  ``entry_json`` gives them, then ``"backend": "xla"`` where it says so (``"pallas"``, the
  default, is not written); another value raises ``ValueError``."""
  def canonical(entry: dict) -> dict:
    entry = dict(entry)
    backend = entry.pop("backend", PALLAS)
    if backend not in _tuning.BACKENDS:
      raise ValueError(f"backend: expected one of {_tuning.BACKENDS}, got {backend!r}")
    out = entry_json(entry)
    return {**out, "backend": XLA} if backend == XLA else out
  return canonical


def write_table(configs: dict, out: str, *, entry_json: Callable, merge: bool = False,
                per_field: bool = False, device_kind: str | None = None) -> dict:
  """Writes a tuned table ``{class: entry}`` for ``device_kind`` (default: this process's
  first device's) to ``out``, with the device's compute capability and this jax's version;
  returns what it wrote.

  ``entry_json(entry)`` gives an entry as the kernel reads it (its named fields; it raises
  if the entry is not valid); an entry's ``backend`` is kept (:func:`with_backend`).
  ``merge`` keeps the classes of the table already at ``out`` (same device kind) that
  ``configs`` does not replace; with ``per_field`` a class in both keeps the old entry's
  fields (passes, backend) that the new one lacks. An entry that is not valid (an old
  table's, say) is left out, with a message.
  """
  device_kind = device_kind or jax.devices()[0].device_kind
  canonical = with_backend(entry_json)
  old = read_table(out, device_kind) if merge else {}
  table = {}
  for key in set(old) | set(configs):
    tries = []
    if key in configs and key in old and per_field and isinstance(old[key], dict):
      tries.append({**old[key], **configs[key]})
    tries.append(configs[key] if key in configs else old[key])
    error = None
    for entry in tries:
      try:
        table[key] = canonical(entry)
        break
      except (KeyError, TypeError, ValueError) as e:
        error = e
    else:
      print(f"table {out}: class {key} left out, not a valid entry ({type(error).__name__}: "
            f"{error}): {json.dumps(tries[-1])}", flush=True)
  result = {"device_kind": device_kind,
            "compute_capability": compute_capability(device_kind) or _old_capability(out),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "jax": jax.__version__,
            "configs": {k: table[k] for k in sorted(table, key=class_order)}}
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    f.write(dumps(result) + "\n")
  _tuning.clear_caches()
  return result


def time_op(op: str, constants: dict, workload: dict, index: int, measure: Measure, *,
            key: str, calls: int) -> tuple[float | None, float | None]:
  """``(XLA time, Pallas time)`` of the op's forward and backward on a workload, as a user's
  training step runs them: jit of ``jax.value_and_grad`` of ``sum(op(x) * ct)`` with
  ``implementation="xla"`` and ``"pallas"`` (the kernels, with the tables as written so far,
  whatever backend a class is marked with); ``None`` for what did not run."""
  from pallas_kernels import check  # the check tool builds the op's step (no module imports it)

  def one_set(k):
    _, arrays, _, ct = check.op_inputs(op, workload, constants, False, k)
    return (*arrays.values(), ct)
  call, n_grads = check.op_call(op, workload, constants, False, jax.random.key(index))
  made = []

  def make_sets():
    if not made:
      made.append(wl.input_sets(one_set, index, MAX_SETS))
    return made[0]
  candidates = [(name, check.op_value_and_grad(call, n_grads, implementation=name))
                for name in (XLA, PALLAS)]
  times = measure(Trial(op, key, XLA, constants, workload), candidates, make_sets,
                  calls=calls)
  return times.get(XLA), times.get(PALLAS)
