"""Op C's backward at the training-step benchmark's shapes: the kernel entry point (its
default kernels, and each of a few configs of the two-pass scheme) against the jnp
reference backward, and each of the two passes alone, on a GPU.

Usage::

    PYTHONPATH=. python3 -m benchmarks.c_backward_step [--calls 20] [--out DIR]
        [--shapes 1,32,4096;4,32,1024]              # B,H,S each, D = 128, dense
        [--rows 16/128/4/2,32/128/4/2]               # row-pass configs (block_q/block_k/warps/stages)

Every variant's gradients are checked against the reference with the spec's tolerance
(rtol 0.05, atol 1e-5, >= 99% of the elements). Median device time (JAX profiler), two input
sets rotated. Writes ``<out>/c_backward_step.json``; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from benchmarks.timing import compile_all, device_times_us, no_gpu
from jax_ops.ops.qk_scale_softmax import reference
from pallas_kernels import qk_scale_softmax as kernels
from pallas_kernels.qk_scale_softmax import PassConfig, pallas_triton

SHAPES = [(1, 32, 4096), (4, 32, 1024)]
D = 128


def within(out, ref, rtol=0.05, atol=1e-5):
  out = np.asarray(out.astype(jnp.float32))
  ref = np.asarray(ref.astype(jnp.float32))
  return float((np.abs(out - ref) <= atol + rtol * np.abs(ref)).mean())


def make_inputs(b, h, s, d, seed):
  """``(g, Q, K, P)`` of a dense problem: randn g, Q and K (bf16), P their softmax."""
  k = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(k[0], (b, h, s, d), jnp.bfloat16)
  kk = jax.random.normal(k[1], (b, h, s, d), jnp.bfloat16)
  p = reference.qk_scale_softmax_forward(q, kk, d ** -0.5)
  g = jax.random.normal(k[2], (b, h, s, s), jnp.bfloat16)
  return g, q, kk, p


def parse_shapes(text):
  return [tuple(map(int, s.split(","))) for s in text.split(";")] if text else SHAPES


def parse_rows(text):
  return [PassConfig(*map(int, c.split("/"))) for c in text.split(",") if c]


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--out", default=".")
  parser.add_argument("--shapes", default="")
  parser.add_argument("--rows", default="16/128/4/2,64/128/8/2,32/64/4/3")
  args = parser.parse_args(argv)
  shapes, rows_cfgs = parse_shapes(args.shapes), parse_rows(args.rows)
  if no_gpu("timing op C's backward", "nothing timed"):
    return 2
  scaling = D ** -0.5
  out_rows, ok = [], True
  for b, h, s in shapes:
    sets = [make_inputs(b, h, s, D, i) for i in range(2)]
    kind = jax.devices()[0].device_kind
    base = kernels.default_config(s, s, D, jnp.bfloat16, kind)
    # The row-pass variants replace the two-pass scheme's row kernel (short rows' default
    # may be the one-kernel per_head scheme).
    two_pass = kernels.default_config(s, s, D, jnp.bfloat16, kind, schemes=("two_pass",))
    names = ["xla", "pallas"] + [f"row {c.block_q}/{c.block_k}/{c.num_warps}/{c.num_stages}"
                                 for c in rows_cfgs]
    fns = [lambda g, q, kk, p: reference.qk_scale_softmax_backward_reference(g, q, kk, p, scaling),
           lambda g, q, kk, p: pallas_kernels.qk_scale_softmax_backward(g, q, kk, p, scaling)]
    for c in rows_cfgs:
      cfg = dataclasses.replace(two_pass, row=c)
      fns.append(lambda g, q, kk, p, cfg=cfg: pallas_triton.qk_scale_softmax_backward(
          g, q, kk, p, scaling, config=cfg))
    compiled = compile_all(fns, sets[0])
    ref = compiled[0](*sets[0])
    live = [(n, f) for n, f in zip(names, compiled) if f is not None]
    times = device_times_us([f for _, f in live], sets, calls=args.calls)
    row = {"shape": [b, h, s, D], "default_config": str(base), "results": {}}
    for (name, fn), t in zip(live, times):
      dq, dk = fn(*sets[0])
      fq, fk = within(dq, ref[0]), within(dk, ref[1])
      good = fq >= 0.99 and fk >= 0.99
      ok &= good
      row["results"][name] = {"us": t["median_us"], "kernels": t["kernels_per_call"],
                              "within_dq": fq, "within_dk": fk}
    # The passes alone (default config): the row pass (delta, dQ), the column pass (dK).
    g3 = [(x[0].reshape(b * h, s, s), x[3].reshape(b * h, s, s), x[1].reshape(b * h, s, D),
           x[2].reshape(b * h, s, D)) for x in sets]
    scale = jnp.asarray(scaling, jnp.float32).reshape(1)
    if base.scheme == "two_pass":
      rowf = jax.jit(lambda g, p, q, kk: pallas_triton.row_pass(
          scale, g, p, kk, causal=False, cfg=base.row, interpret=False))
      delta = [rowf(*x)[1] for x in g3]
      colf = jax.jit(lambda g, p, q, dl: pallas_triton.col_pass(
          scale, g, p, q, dl, causal=False, cfg=base.col, interpret=False))
      rt = device_times_us([rowf], g3, calls=args.calls)[0]["median_us"]
      ct = device_times_us([colf], [(x[0], x[1], x[2], d) for x, d in zip(g3, delta)],
                           calls=args.calls)[0]["median_us"]
      row["row_pass_us"], row["col_pass_us"] = rt, ct
    out_rows.append(row)
    xla = row["results"]["xla"]["us"]
    print(f"B={b} H={h} S={s} (default {base.scheme}): "
          + "; ".join(f"{n} {r['us']:.0f} us (xla/this {xla / r['us']:.2f}, "
                      f"dq {r['within_dq']:.4f}, dk {r['within_dk']:.4f})"
                      for n, r in row["results"].items())
          + (f"; row pass {row['row_pass_us']:.0f} us, col pass {row['col_pass_us']:.0f} us"
             if "row_pass_us" in row else ""), flush=True)
  with open(os.path.join(args.out, "c_backward_step.json"), "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "rows": out_rows}, f, indent=1)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
