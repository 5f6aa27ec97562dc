"""An experiment for op C's long rows: dQ by fp32 atomics from the column pass.

Not a kernel of the library: a variant to measure before building on it. Today's backward
(``pallas_kernels.qk_scale_softmax_backward``, two-pass scheme) moves 12 B per element
(row pass: ``g`` and ``P`` twice; column pass: once). This variant moves 8 B plus atomics:

1. ``delta = rowsum(g * P)`` (fp32), a jnp reduction (one read of ``g`` and ``P``);
2. one column kernel: a program owns ``block_k`` keys of one head (their ``K`` rows held in
   registers) and walks the query tiles: ``dL`` once per tile (the reference's roundings),
   ``dK += dL^T @ Q_i`` in registers, and ``dL @ K_tile`` added into an fp32 ``dQ`` with
   ``pltriton.atomic_add`` (``D / block_k`` fp32 atomics per attention element, into L2);
3. ``dQ`` rounded to the input dtype.

Usage (on a GPU)::

    PYTHONPATH=. python3 -m benchmarks.c_dq_atomic [--shapes 1,32,4096;4,32,1024]
        [--configs 64/128/8/2,32/128/4/2]     # block_q/block_k/num_warps/num_stages
        [--calls 20] [--out DIR]

Off a GPU, ``--interpret`` checks the variant against the reference in the interpreter on a
small problem (and times nothing). Every variant is checked with the spec's tolerance (rtol
0.05, atol 1e-5, >= 99% of the elements) against the reference backward; median device time
(JAX profiler), two input sets rotated, beside the library's backward and XLA's. Writes
``<out>/c_dq_atomic.json``; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from benchmarks.c_backward_step import D, make_inputs, parse_rows, parse_shapes, within
from benchmarks.timing import compile_all, device_times_us, no_gpu
from jax_ops.ops.qk_scale_softmax import reference
from pallas_kernels._util import compiler_params, dot, out_struct, pallas_call
from pallas_kernels.qk_scale_softmax import PassConfig
from pallas_kernels.qk_scale_softmax.pallas_triton import _ZERO, _ColTiles, _dl_tile, _fori_loop

F32 = jnp.float32


def _kernel(scale_ref, g_ref, p_ref, q_ref, k_ref, delta_ref, dq_in_ref, dk_ref, dq_ref,
            **dims):
  """Refs: scale [1], g and P [B*H, Sq, Sk], Q [B*H, Sq, D], K [B*H, Sk, D], delta
  [B*H, Sq] fp32, dQ [B*H, Sq', D'] fp32 (zeros, padded to whole tiles, aliased to
  ``dq_ref``) -> dK [B*H, Sk, D], dQ (accumulated with atomics)."""
  del dq_in_ref  # the same buffer as dq_ref
  c = _ColTiles(scale_ref, g_ref, p_ref, q_ref, delta_ref, **dims)
  k = pltriton.load(k_ref.at[c.bh, pl.ds(c.k_start, c.block_k), pl.ds(_ZERO, c.d_pad)],
                    mask=c.col_ok[:, None] & c.d_ok[None, :], other=0.0)

  def body(i, acc):
    g, p = c.gp(i, diagonal=False)
    q_start = i * c.block_q
    row_ok = q_start + jnp.arange(c.block_q, dtype=jnp.int32) < c.seq_q
    delta = pltriton.load(c.delta_ref.at[c.bh, pl.ds(q_start, c.block_q)], mask=row_ok,
                          other=0.0)
    idx = (c.bh, pl.ds(q_start, c.block_q), pl.ds(_ZERO, c.d_pad))
    mask = row_ok[:, None] & c.d_ok[None, :]
    q = pltriton.load(c.q_ref.at[idx], mask=mask, other=0.0)
    d_l = _dl_tile(g, p, delta, c.scale, c.dtype)
    # dQ is padded to whole tiles (rows of block_q, columns of d_pad): no mask (the
    # interpreter takes none on atomics); padded rows and columns add zeros.
    pltriton.atomic_add(dq_ref, idx, dot(d_l, k))
    return acc + dot(d_l, q, trans_a=True)

  acc = _fori_loop(0, c.num_q_tiles, body, c.zero_acc())
  c.store(dk_ref, acc)


def row_delta(g, p):
  """``rowsum(g * P)`` in fp32 (step 1, a jnp reduction)."""
  return jnp.sum(g.astype(F32) * p.astype(F32), axis=-1)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def backward(grad_output, query, key, attn_weights, scaling, *, cfg, interpret=False):
  """``(grad_query, grad_key)`` of the variant (dense P), arrays ``[B, H, ...]``."""
  b, h, seq_q, d = query.shape
  seq_k = key.shape[2]
  bh = b * h
  g = grad_output.reshape(bh, seq_q, seq_k)
  p = attn_weights.reshape(bh, seq_q, seq_k)
  q = query.reshape(bh, seq_q, d)
  k = key.reshape(bh, seq_k, d)
  delta = row_delta(g, p)
  scale = jnp.asarray(scaling, F32).reshape(1)
  d_pad = max(16, pl.next_power_of_2(d))
  dq0 = jnp.zeros((bh, pl.cdiv(seq_q, cfg.block_q) * cfg.block_q, d_pad), F32)
  args = (scale, g, p, q, k, delta, dq0)
  dk, dq = pallas_call(
      functools.partial(_kernel, seq_q=seq_q, seq_k=seq_k, head_dim=d, block_q=cfg.block_q,
                        block_k=cfg.block_k),
      out_shape=(out_struct((bh, seq_k, d), query.dtype, *args),
                 out_struct(dq0.shape, F32, *args)),
      input_output_aliases={6: 1},
      grid=(pl.cdiv(seq_k, cfg.block_k), bh),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="qk_scale_softmax_bwd_dq_atomic",
  )(*args)
  dq = dq[:, :seq_q, :d].astype(query.dtype)
  return dq.reshape(b, h, seq_q, d), dk.reshape(b, h, seq_k, d)


def check_interpret(b=1, h=2, s=45, d=40, cfg=PassConfig(16, 16, 4, 1)) -> bool:
  """The variant against the reference in the interpreter (odd lengths, D padded)."""
  g, q, kk, p = make_inputs(b, h, s, d, 0)
  dq, dk = backward(g, q, kk, p, d ** -0.5, cfg=cfg, interpret=True)
  rq, rk = reference.qk_scale_softmax_backward_reference(g, q, kk, p, d ** -0.5)
  fq, fk = within(dq, rq), within(dk, rk)
  print(f"interpreter, ({b}, {h}, {s}, {s}), D={d}: dq {fq:.4f}, dk {fk:.4f} within tolerance")
  return fq >= 0.99 and fk >= 0.99


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--out", default=".")
  parser.add_argument("--shapes", default="")
  parser.add_argument("--configs", default="64/128/8/2,32/128/4/2,64/64/4/3")
  parser.add_argument("--interpret", action="store_true",
                      help="check the variant in the interpreter (no GPU needed)")
  args = parser.parse_args(argv)
  configs, shapes = parse_rows(args.configs), parse_shapes(args.shapes)
  if args.interpret:
    return 0 if check_interpret() else 1
  if no_gpu("timing the dQ-atomic variant of op C's backward",
            "--interpret checks it in the interpreter"):
    return 2
  import pallas_kernels
  rows, ok = [], True
  for b, h, s in shapes:
    sets = [make_inputs(b, h, s, D, i) for i in range(2)]
    scaling = D ** -0.5
    names = ["xla", "library"] + [f"atomic {c.block_q}/{c.block_k}/{c.num_warps}/{c.num_stages}"
                                  for c in configs] + ["delta alone"]
    fns = [lambda g, q, kk, p: reference.qk_scale_softmax_backward_reference(g, q, kk, p,
                                                                             scaling),
           lambda g, q, kk, p: pallas_kernels.qk_scale_softmax_backward(g, q, kk, p, scaling)]
    fns += [lambda g, q, kk, p, c=c: backward(g, q, kk, p, scaling, cfg=c) for c in configs]
    fns.append(lambda g, q, kk, p: row_delta(g, p))
    compiled = compile_all(fns, sets[0])
    live = [(n, f) for n, f in zip(names, compiled) if f is not None]
    for n, f in zip(names, compiled):
      if f is None:
        print(f"  did not compile: {n}", flush=True)
    times = device_times_us([f for _, f in live], sets, calls=args.calls)
    ref = compiled[0](*sets[0])
    row = {"shape": [b, h, s, D], "results": {}}
    for (name, fn), t in zip(live, times):
      entry = {"us": t["median_us"]}
      if name != "delta alone":
        dq, dk = fn(*sets[0])
        entry["within_dq"], entry["within_dk"] = within(dq, ref[0]), within(dk, ref[1])
        ok &= entry["within_dq"] >= 0.99 and entry["within_dk"] >= 0.99
      row["results"][name] = entry
    rows.append(row)
    print(f"B={b} H={h} S={s}: " + "; ".join(
        f"{n} {r['us']:.0f} us" + (f" (dq {r['within_dq']:.4f}, dk {r['within_dk']:.4f})"
                                   if "within_dq" in r else "")
        for n, r in row["results"].items()), flush=True)
  with open(os.path.join(args.out, "c_dq_atomic.json"), "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
