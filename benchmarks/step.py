"""The ops as a training step uses them: jitted ``value_and_grad`` of each op, XLA path vs
Pallas path, in one run.

Usage (on a GPU)::

    PYTHONPATH=. python3 -m benchmarks.step [--calls 20] [--op NAME ...] [--out DIR]

For each step shape (``STEPS``) it builds
``loss = sum(op(x) * w)`` for a fixed random ``w``, jits ``jax.value_and_grad`` of it with
``implementation="xla"`` and with the default (Pallas) path, and reports the median device time
(JAX profiler, all kernels of a call; two input sets rotated), the speedup and the compiled
temporary memory (``memory_analysis().temp_size_in_bytes``). Writes ``<out>/step.md``,
``.json`` and ``.png`` with the date, device, jax version and commit, by default in
``benchmarks/results/<device>/``; each JSON row holds the step's times (``xla_us``,
``pallas_us``, the forwards') and temporary memory (``xla_temp_mb``, ``pallas_temp_mb``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jax_ops
from benchmarks import run
from pallas_kernels._timing import device_times_us, kernel_breakdown_us, no_gpu
from pallas_kernels._util import first_paragraph

F32, BF16 = jnp.float32, jnp.bfloat16
RATE = 0.1
ATTENTION = "attention_softmax_dropout_value"
MASKED = "masked_softmax_dropout"
QK = "qk_scale_softmax"


@dataclasses.dataclass(frozen=True)
class Step:
  op: str                  # the op's name in the registry
  label: str
  make: Callable           # key -> (primals tuple, weight w)
  loss: Callable           # (primals, w, implementation, rng, interpret) -> scalar


def attention_step(b, s, *, h=80, kvh=8, d=128):
  def make(key):
    k = jax.random.split(key, 3)
    scores = jax.random.normal(k[0], (b, h, s, s), BF16)
    value = jax.random.normal(k[1], (b, kvh, s, d), BF16)
    w = jax.random.normal(k[2], (b, s, h, d), BF16)
    return (scores, value), w

  def loss(primals, w, impl, rng, interpret=False):
    out = jax_ops.attention_softmax_dropout_value(
        *primals, dropout_rate=RATE, dropout_rng=rng, implementation=impl, interpret=interpret)
    return jnp.sum(out.astype(F32) * w.astype(F32))
  return Step(ATTENTION, f"{ATTENTION}, B={b} S={s} (H={h}, KVH={kvh}, D={d})", make, loss)


def masked_step(b, h, s):
  def make(key):
    k = jax.random.split(key, 3)
    scores = jax.random.normal(k[0], (b, h, s, s), F32)
    mask = jax.random.bernoulli(k[1], 0.5, (b, 1, s, s))
    w = jax.random.normal(k[2], (b, h, s, s), F32)
    return (scores, mask), w

  def loss(primals, w, impl, rng, interpret=False):
    scores, mask = primals
    out = jax_ops.masked_softmax_dropout(scores, mask, dropout_rate=RATE, dropout_rng=rng,
                                         implementation=impl, interpret=interpret)
    return jnp.sum(out * w)
  return Step(MASKED, f"{MASKED}, B={b} H={h} S={s}", make, loss)


def qk_step(b, h, s, *, causal=False, d=128):
  def make(key):
    k = jax.random.split(key, 3)
    query = jax.random.normal(k[0], (b, h, s, d), BF16)
    key_ = jax.random.normal(k[1], (b, h, s, d), BF16)
    w = jax.random.normal(k[2], (b, h, s, s), BF16)
    return (query, key_), w

  def loss(primals, w, impl, rng, interpret=False):
    out = jax_ops.qk_scale_softmax(*primals, causal=causal, implementation=impl,
                                   interpret=interpret)
    return jnp.sum(out.astype(F32) * w.astype(F32))
  name = f"{QK} causal" if causal else QK
  return Step(QK, f"{name}, B={b} H={h} S={s}", make, loss)


STEPS = [
    attention_step(2, 2048), attention_step(8, 512), attention_step(4, 1024),
    masked_step(8, 16, 1024), masked_step(32, 8, 256), masked_step(16, 8, 2048),
    qk_step(1, 32, 4096), qk_step(4, 32, 1024), qk_step(1, 32, 4096, causal=True),
    qk_step(32, 32, 128), qk_step(8, 32, 256),
]
OPS = (ATTENTION, MASKED, QK)


def step_fn(step: Step, impl, interpret=False):
  """The jitted training step: loss and gradients w.r.t. the op's differentiable inputs
  (``interpret``: the Pallas kernels in the interpreter, for tests off a GPU)."""
  argnums = 0 if step.op == MASKED else (0, 1)

  def fn(primals, w, rng):
    def f(*x):
      full = tuple(x) + tuple(primals[len(x):])
      return step.loss(full, w, impl, rng, interpret)
    diff = primals[:1] if step.op == MASKED else primals
    return jax.value_and_grad(f, argnums=argnums)(*diff)
  return jax.jit(fn)


def forward_fn(step: Step, impl="xla", interpret=False):
  """The step's forward alone (the loss, no gradient) on the path of ``impl``: jnp on the
  XLA path; on the Pallas path the fused forward kernels of masked_softmax_dropout and
  qk_scale_softmax, and of attention_softmax_dropout_value where its Mosaic GPU backend runs
  or its Triton backend on rows of >= 512 keys."""
  return jax.jit(lambda primals, w, rng: step.loss(primals, w, impl, rng, interpret))


def temp_mb(compiled) -> float:
  """The compiled step's temporary buffers, in MB."""
  return compiled.memory_analysis().temp_size_in_bytes / 2 ** 20


def measure(step: Step, calls: int) -> dict:
  """The step's row: its times and temporary memory on the XLA and the default path."""
  sets = []
  for i in range(2):
    primals, w = step.make(jax.random.key(i))
    sets.append((primals, w, jax.random.key(100 + i)))
  # Compiled once: the executables are timed and give their memory.
  fns = {name: step_fn(step, impl).lower(*sets[0]).compile()
         for name, impl in (("xla", "xla"), ("pallas", None))}
  row = {"op": step.op, "step": step.label}
  for name, fn in fns.items():
    row[f"{name}_temp_mb"] = temp_mb(fn)
  times = device_times_us([*fns.values(), forward_fn(step), forward_fn(step, None)], sets,
                          calls=calls)
  row["xla_us"], row["pallas_us"] = times[0]["median_us"], times[1]["median_us"]
  row["forward_us"], row["pallas_forward_us"] = times[2]["median_us"], times[3]["median_us"]
  row["split_ok"] = all(t["split_ok"] for t in times)
  row["speedup"] = row["xla_us"] / row["pallas_us"]
  return row


def markdown(meta, rows) -> str:
  lines = ["# Training step: jitted value_and_grad of each op, XLA path vs Pallas path", "",
           f"- date: {meta['date']}", f"- device: {meta['device']}", f"- jax: {meta['jax']}",
           f"- commit: {meta['commit']}",
           f"- times: median device time (JAX profiler, all kernels of a call), {meta['calls']} "
           "calls, two input sets rotated; memory: the compiled step's temporary buffers",
           f"- dropout rate {RATE} ({ATTENTION}, {MASKED}), the keep mask of `jax_ops.dropout_keep_mask` on both "
           "paths; the XLA path is jnp throughout; the Pallas path runs the Pallas backward "
           f"kernels and their fused forward kernels ({ATTENTION}'s where its Mosaic GPU backend runs, "
           "or its Triton backend on rows of >= 512 keys)", "",
           "- forward: the loss alone, no gradient, on each path; a step's backward is about "
           "its time minus its forward's", "",
           "| step | XLA path us | Pallas path us | speedup | forward us, XLA / Pallas | "
           "temp memory, XLA / Pallas MB |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    extra = ""
    if not r.get("split_ok", True):
      extra += " (calls not told apart in the trace: mean, not median)"
    forward = "-"
    if "forward_us" in r:
      forward = f"{r['forward_us']:.0f}"
      if "pallas_forward_us" in r:
        forward += f" / {r['pallas_forward_us']:.0f}"
    lines.append(f"| {r['step']}{extra} | {r['xla_us']:.0f} | {r['pallas_us']:.0f} | "
                 f"{r['speedup']:.2f}x | {forward} | "
                 f"{r['xla_temp_mb']:.0f} / {r['pallas_temp_mb']:.0f} |")
  return "\n".join(lines) + "\n"


def write_chart(rows, png_path, meta=None):
  """Bars of the speedup of the Pallas path over the XLA path per step (1.0: a tie); the
  title names the device, date and commit of ``meta``."""
  try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ImportError:
    print(f"chart: matplotlib is not installed, no chart {png_path}")
    return None
  fig = Figure(figsize=(max(6.0, 1.4 + 0.7 * len(rows)), 4.8), dpi=100)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  colors = {ATTENTION: "#1f77b4", MASKED: "#2ca02c", QK: "#9467bd"}
  xs = range(len(rows))
  ax.bar(xs, [r["speedup"] for r in rows], color=[colors.get(r["op"], "gray") for r in rows])
  ax.axhline(1.0, color="black", linewidth=0.8)
  ax.set_xticks(list(xs), [r["step"].replace(" (", "\n(") for r in rows], rotation=60,
                ha="right", fontsize=7)
  ax.set_ylabel("speedup of the Pallas path over XLA")
  title = "Training step (jitted value_and_grad), device time"
  if meta:
    import textwrap
    tail = f"{meta['device']}  |  {meta['date']}  |  jax {meta['jax']}  |  commit {meta['commit']}"
    title = "\n".join([title, *textwrap.wrap(tail, int(fig.get_figwidth() * 14))])
  ax.set_title(title, fontsize=9, loc="left")
  fig.tight_layout()
  fig.savefig(png_path)
  return png_path


def main(argv=None):
  parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--op", action="append", choices=OPS,
                      help="op(s) whose steps to time; default: all")
  parser.add_argument("--out", default=None,
                      help="results folder (default: benchmarks/results/<device>/)")
  parser.add_argument("--profile", action="store_true",
                      help="instead of the table: where each chosen step's device time goes on "
                           "the Pallas path, per kernel (printed, and step_profile.json)")
  args = parser.parse_args(argv)
  if no_gpu("the step benchmark"):
    return 2
  ops = set(args.op or OPS)
  meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": jax.devices()[0].device_kind, "jax": jax.__version__,
          "commit": run._commit(), "calls": args.calls}
  args.out = args.out or run.results_dir(meta["device"])
  os.makedirs(args.out, exist_ok=True)
  # A run of some ops writes step_subset.*, so it never replaces a full run's results.
  base = os.path.join(args.out, "step_subset" if ops != set(OPS) else "step")
  if args.profile:
    return _profile([s for s in STEPS if s.op in ops], args, meta)
  rows = []
  for step in STEPS:
    if step.op not in ops:
      continue
    row = measure(step, args.calls)
    rows.append(row)
    print(f"{row['step']:60s} xla {row['xla_us']:9.0f} us  pallas {row['pallas_us']:9.0f} us  "
          f"x{row['speedup']:.2f}  temp {row['xla_temp_mb']:.0f}/{row['pallas_temp_mb']:.0f} MB",
          flush=True)
    write(base, meta, rows)   # after each step: a run cut short keeps what it measured
  write_chart(rows, base + ".png", meta)
  print(markdown(meta, rows))
  return 0


def _profile(steps, args, meta):
  """``--profile``: the Pallas path's kernels per step, their median time per call."""
  out = []
  for step in steps:
    sets = []
    for i in range(2):
      primals, w = step.make(jax.random.key(i))
      sets.append((primals, w, jax.random.key(100 + i)))
    fn = step_fn(step, None).lower(*sets[0]).compile()
    rows = kernel_breakdown_us(fn, sets, calls=args.calls)
    total = sum(r["median_us"] for r in rows)
    print(f"{step.label}: {total:.0f} us in all (sum of per-kernel medians)")
    for r in rows:
      print(f"  {r['median_us']:8.1f} us  x{r['launches']:g}  {r['kernel'][:110]}")
    out.append({"step": step.label, "kernels": rows})
  with open(os.path.join(args.out, "step_profile.json"), "w") as f:
    json.dump({**meta, "steps": out}, f, indent=1)
  return 0


def write(base, meta, rows):
  with open(base + ".json", "w") as f:
    json.dump({**meta, "rows": rows}, f, indent=1)
  with open(base + ".md", "w") as f:
    f.write(markdown(meta, rows))


if __name__ == "__main__":
  sys.exit(main())
