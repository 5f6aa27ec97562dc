"""Checks the kernels and the ops on this machine's device, against their references.

Usage::

    python -m pallas_kernels.check            # a GPU: every workload of the spec, compiled
    python -m pallas_kernels.check --quick    # small shapes (odd lengths too); CPU: interpreted
    python -m pallas_kernels.check --op qk_scale_softmax [--op ...] [--interpret] [--calls N]

Per op, per workload (``pallas_kernels/workloads.json``: the spec's 16, plus qk_scale_softmax's
square ones with a causal P; ``--quick``: :data:`pallas_kernels.workloads.QUICK`), two cases:

* ``kernel``: the entry point ``pallas_kernels.<op>_backward`` against
  ``jax_ops.reference.<op>_backward_reference`` at the workload's tolerance, by the spec's
  rule (:func:`pallas_kernels.workloads.check`: >= 99% of the elements within
  ``atol + rtol * |ref|``, no NaN/Inf);
* ``op fwd+bwd``: ``jax.value_and_grad`` of ``jax_ops.<op>`` on the backend the device picks,
  against ``implementation="xla"`` on the same inputs and dropout key: the output and each
  gradient, by the same rule at :data:`OP_TOLERANCE`.

A row per case names the backend that ran, the device time against XLA's (a GPU,
:mod:`pallas_kernels._timing`; else ``-``) and which tuned tables served the call
(``pallas_kernels._tuning.table_source`` of the op's kernel; ``heuristic`` in the
interpreter). Off a GPU the kernels always run in the Pallas interpreter. Exits 1 if a case fails.
"""

from __future__ import annotations

import argparse
import functools
import sys
import traceback

import jax
import jax.numpy as jnp

import jax_ops
import pallas_kernels
from jax_ops import reference, registry
from jax_ops.backend import Problem
from pallas_kernels import _tuning
from pallas_kernels import workloads as wl
from pallas_kernels._timing import device_times_us
from pallas_kernels._util import first_paragraph

F32 = jnp.float32
CAUSAL = "qk_scale_softmax"  # the op whose workloads also run with a causal P
# The op's output and gradients against the XLA path's: (atol as a fraction of max |ref|,
# rtol) for 16-bit inputs, whose forward residuals round; (atol, rtol) for fp32.
OP_TOLERANCE = {"bfloat16": (2e-2, 5e-2), "float16": (2e-2, 5e-2), "float32": (1e-5, 1e-5)}
COLUMNS = (("op", 31), ("entry", 10), ("shape", 26), ("check", 5), ("max err (worst output)", 28),
           ("tolerance", 19), ("within", 8), ("backend", 22), ("vs XLA", 24), ("tables", 0))


def shape_label(op, w, c, causal=False):
  if op == wl.OPS[0]:
    b, h, kvh, sq, skv, d = wl.attention_dims(w, c)
    return f"B{b} H{h}/{kvh} {sq}x{skv} D{d} p{c['attention_dropout']}"
  if op == wl.OPS[1]:
    return f"B{w['batch_size']} H{w['n_heads']} {w['seq_len']}x{w['seq_len']} p{w['p_dropout']}"
  b, h, sq, sk, d = wl.qk_dims(w, c)
  return f"B{b} H{h} {sq}x{sk} D{d}" + (" causal" if causal else "")


def cases(ops, quick):
  """``(op, constants, workload, causal, index)`` per workload of each op, in order."""
  for op in ops:
    for causal in (False, True) if op == CAUSAL else (False,):
      constants, ws = wl.problem(op, quick=quick, causal=causal)
      for index, w in enumerate(ws):
        yield op, constants, w, causal, index


# --- the op's forward and backward --------------------------------------------------------

def op_call(op, w, c, causal, key):
  """``(call, n_grads)``: ``call(*arrays, **kw)`` runs the op on a workload's arrays (those
  of :func:`op_inputs`) with its scalars and the dropout key drawn from ``key``,
  differentiable in its first ``n_grads`` arrays."""
  k = jax.random.split(key, 5)
  if op == wl.OPS[0]:
    return functools.partial(jax_ops.attention_softmax_dropout_value,
                             dropout_rate=c["attention_dropout"], dropout_rng=k[3]), 2
  if op == wl.OPS[1]:
    return functools.partial(jax_ops.masked_softmax_dropout, dropout_rate=w["p_dropout"],
                             dropout_rng=k[3]), 1
  return functools.partial(jax_ops.qk_scale_softmax, scaling=c["scaling"], causal=causal), 2


def op_inputs(op, w, c, causal, key):
  """``(call, arrays, n_grads, cotangent)``: :func:`op_call` and the arrays it runs on,
  named as the op's backend choice names them."""
  call, n_grads = op_call(op, w, c, causal, key)
  k = jax.random.split(key, 5)
  if op == wl.OPS[0]:
    b, h, kvh, sq, skv, d = wl.attention_dims(w, c)
    primals = (jax.random.normal(k[0], (b, h, sq, skv), wl.BF16),
               jax.random.normal(k[1], (b, kvh, skv, d), wl.BF16))
    ct = jax.random.normal(k[2], (b, sq, h, d), wl.BF16)
    return call, dict(zip(("scores", "value_states"), primals)), n_grads, ct
  if op == wl.OPS[1]:
    b, h, s = w["batch_size"], w["n_heads"], w["seq_len"]
    scores = jax.random.normal(k[0], (b, h, s, s), F32)
    mask = jax.random.bernoulli(k[1], 0.7, (b, 1, s, s))
    ct = jax.random.normal(k[2], (b, h, s, s), F32)
    return call, {"scores": scores, "mask": mask}, n_grads, ct
  b, h, sq, sk, d = wl.qk_dims(w, c)
  primals = (jax.random.normal(k[0], (b, h, sq, d), wl.BF16),
             jax.random.normal(k[1], (b, h, sk, d), wl.BF16))
  ct = jax.random.normal(k[2], (b, h, sq, sk), wl.BF16)
  return call, dict(zip(("query", "key"), primals)), n_grads, ct


def op_value_and_grad(call, n_grads, **kw):
  """jit of ``(*arrays, ct) -> (out, *grads)``: ``jax.value_and_grad`` of ``sum(out * ct)``."""
  def loss(*args):
    out = call(*args[:-1], **kw)
    return jnp.sum(out.astype(F32) * args[-1].astype(F32)), out
  grad = jax.value_and_grad(loss, argnums=tuple(range(n_grads)), has_aux=True)

  def run(*args):
    (_, out), grads = grad(*args)
    return (out, *grads)
  return jax.jit(run)


def op_backend(op, arrays, causal, interpret):
  """``"<backend> (<residual policy>)"``: what ``implementation=None`` runs for the call."""
  first = next(iter(arrays.values()))
  problem = Problem(op=op, shapes=tuple((k, tuple(v.shape)) for k, v in arrays.items()),
                    dtype=jnp.dtype(first.dtype).name, causal=causal,
                    device=jax.devices()[0], interpret=interpret)
  backend = registry.resolve(op, None, problem)
  return f"{backend.name} ({backend.residual_policy(problem)})"


def op_checks(outs, refs, names):
  results = []
  for out, ref, name in zip(outs, refs, names):
    a, rtol = OP_TOLERANCE[jnp.dtype(ref.dtype).name]
    atol = a * float(jnp.max(jnp.abs(ref.astype(F32)))) if ref.dtype != F32 else a
    results.append((name, wl.check(out, ref, atol, rtol), atol, rtol))
  return results


OUTPUT_NAMES = {wl.OPS[0]: ("out", "d_scores", "d_value"), wl.OPS[1]: ("out", "d_scores"),
                wl.OPS[2]: ("out", "d_query", "d_key")}
BACKWARD_NAMES = {wl.OPS[0]: ("d_scores", "d_value"), wl.OPS[1]: ("d_scores",),
                  wl.OPS[2]: ("d_query", "d_key")}


# --- the cases ------------------------------------------------------------------------------

def run_kernel(op, c, w, causal, index, interpret, timed, calls):
  """The entry point against the reference backward: ``(checks, backend, time)``."""
  p = wl.scalar(op, w, c)
  kw = {"causal": True} if causal else {}
  entry = getattr(pallas_kernels, op + "_backward")
  ref_fn = getattr(reference, op + "_backward_reference")
  kernel = jax.jit(lambda *a: entry(*a, p, interpret=interpret, **kw))
  xla = jax.jit(lambda *a: ref_fn(*a, p))
  make = lambda key: wl.make_inputs(op, w, c, key, causal)
  args = make(jax.random.key(index))
  outs, refs = kernel(*args), xla(*args)
  outs, refs = (outs if isinstance(outs, tuple) else (outs,)), (
      refs if isinstance(refs, tuple) else (refs,))
  checks = [(name, wl.check(o, r, w["atol"], w["rtol"]), w["atol"], w["rtol"])
            for o, r, name in zip(outs, refs, BACKWARD_NAMES[op])]
  used = wl.entry_kernels(op, args, c, causal=causal, interpret=interpret)
  del outs, refs, args  # the timing makes its own input sets
  time = timed([kernel, xla], lambda: wl.input_sets(make, index), calls)
  return checks, used, time


def run_op(op, c, w, causal, index, interpret, timed, calls):
  """The op's forward and backward, Pallas path against the XLA path."""
  call, arrays, n_grads, ct = op_inputs(op, w, c, causal, jax.random.key(index))
  pallas = op_value_and_grad(call, n_grads, interpret=interpret)
  xla = op_value_and_grad(call, n_grads, implementation="xla")
  checks = op_checks(pallas(*arrays.values(), ct), xla(*arrays.values(), ct), OUTPUT_NAMES[op])
  used = op_backend(op, arrays, causal, interpret)
  del arrays, ct  # the timing makes its own input sets

  def one_set(key):
    _, arrays_, _, ct_ = op_inputs(op, w, c, causal, key)
    return (*arrays_.values(), ct_)
  return checks, used, timed([pallas, xla], lambda: wl.input_sets(one_set, index), calls)


def make_timer(enabled):
  """``timed(fns, make_sets, calls) -> str``: Pallas and XLA device time and the speedup,
  or ``-`` where nothing is timed (the interpreter, no GPU)."""
  def timed(fns, make_sets, calls):
    if not enabled:
      return "-"
    try:
      pallas, xla = device_times_us(fns, make_sets(), calls=calls)
    except Exception as e:  # noqa: BLE001 - a timing that fails costs its column, not the check
      return f"- ({type(e).__name__})"
    return (f"{pallas['median_us']:.1f} / {xla['median_us']:.1f} us "
            f"x{xla['median_us'] / pallas['median_us']:.2f}")
  return timed


# --- the table ------------------------------------------------------------------------------

def format_row(values):
  return "  ".join(str(v).ljust(width) for v, (_, width) in zip(values, COLUMNS)).rstrip()


def row_of(op, entry, shape, checks, used, time, tables):
  """The table's row, with the worst output: a failing one first, then the lowest fraction
  within tolerance, then the largest error over ``atol``."""
  name, worst, atol, rtol = min(checks, key=lambda t: (t[1]["ok"], t[1]["within"],
                                                       -t[1]["max_err"] / max(t[2], 1e-30)))
  ok = all(chk["ok"] for _, chk, _, _ in checks)
  return ok, format_row([op, entry, shape, "pass" if ok else "FAIL",
                         f"{name}: {worst['max_err']:.3g}"
                         + ("" if worst["finite"] else " (NaN/Inf)")
                         + ("" if worst["nonzero"] else " (all zero)"),
                         f"{atol:.2g} + {rtol:g}|ref|", f"{worst['within']:.2%}", used, time,
                         tables])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
  parser.add_argument("--op", action="append", choices=wl.OPS,
                      help="op(s) to check (repeatable); default: all three")
  parser.add_argument("--quick", action="store_true",
                      help="a few small workloads, odd lengths too (CI; a CPU)")
  parser.add_argument("--interpret", action="store_true",
                      help="run the Pallas kernels in the interpreter (always, off a GPU)")
  parser.add_argument("--calls", type=int, default=10, help="timed calls per function")
  args = parser.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  interpret = args.interpret or not on_gpu
  device = jax.devices()[0]
  tables = "heuristic" if interpret else _tuning.table_source(device)
  timed = make_timer(on_gpu and not interpret)
  if not on_gpu and not args.quick:
    print("check: no GPU: the spec's workloads run in the Pallas interpreter, which takes "
          "hours; --quick checks small ones", file=sys.stderr)
  print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"{'interpret' if interpret else 'compiled'}, tables: {tables}")
  print(format_row([name for name, _ in COLUMNS]))
  print(format_row(["-" * (width or len(name)) for name, width in COLUMNS]))
  failed = total = 0
  ops = args.op or wl.OPS
  sources = {op: "heuristic" if interpret else _tuning.table_source(device, op) for op in ops}
  for op, c, w, causal, index in cases(ops, args.quick):
    shape = shape_label(op, w, c, causal)
    for entry, run in (("kernel", run_kernel), ("op fwd+bwd", run_op)):
      total += 1
      try:
        ok, line = row_of(op, entry, shape,
                          *run(op, c, w, causal, index, interpret, timed, args.calls),
                          sources[op])
      except Exception as e:  # noqa: BLE001 - a case that raises fails; the others still run
        traceback.print_exc(file=sys.stderr)
        ok, line = False, format_row([op, entry, shape, "FAIL",
                                      f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                                      if str(e) else type(e).__name__])
      failed += not ok
      print(line, flush=True)
  print(f"\n{total - failed} of {total} cases pass" + (f"; {failed} FAIL" if failed else ""))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
