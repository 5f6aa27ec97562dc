"""A jit-compiled training step of a tiny attention model built on the three ops.

Runs the backward passes through the Pallas kernels (on a CPU, in interpret
mode) and through the jnp references, prints how far apart the gradients are,
then trains a few steps. Exits non-zero if the gradients disagree.

    .venv/bin/python examples/demo.py
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp

import jax_ops

B, S, E, H, KVH, D = 2, 24, 32, 4, 2, 16
RATE = 0.1


def init(key):
  k = jax.random.split(key, 4)
  w = lambda kk, shape: jax.random.normal(kk, shape, jnp.float32) / jnp.sqrt(shape[0])
  return {"wq": w(k[0], (E, H * D)), "wk": w(k[1], (E, H * D)), "wv": w(k[2], (E, KVH * D)),
          "wo": w(k[3], (3 * H * D, E))}


def model(params, x, pad_mask, rng, *, implementation, interpret):
  """Three attention paths over the same projections, one per op."""
  ops = dict(implementation=implementation, interpret=interpret)
  bf16 = jnp.bfloat16
  q = (x @ params["wq"]).reshape(B, S, H, D).transpose(0, 2, 1, 3)      # [B, H, S, D]
  k = (x @ params["wk"]).reshape(B, S, H, D).transpose(0, 2, 1, 3)
  v = (x @ params["wv"]).reshape(B, S, KVH, D).transpose(0, 2, 1, 3)    # [B, KVH, S, D]
  v_full = jnp.repeat(v, H // KVH, axis=1)
  scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(D)
  rng_value, rng_masked = jax.random.split(rng)
  # softmax -> dropout -> GQA value matmul, in bf16.
  out_value = jax_ops.attention_softmax_dropout_value(
      scores.astype(bf16), v.astype(bf16), dropout_rate=RATE, dropout_rng=rng_value, **ops)
  # masked softmax -> dropout, in fp32.
  probs_masked = jax_ops.masked_softmax_dropout(scores, pad_mask, dropout_rate=RATE,
                                                dropout_rng=rng_masked, **ops)
  out_masked = jnp.einsum("bhqk,bhkd->bqhd", probs_masked, v_full)
  # causal QK -> scale -> softmax, in bf16.
  probs_qk = jax_ops.qk_scale_softmax(q.astype(bf16), k.astype(bf16), causal=True, **ops)
  out_qk = jnp.einsum("bhqk,bhkd->bqhd", probs_qk.astype(jnp.float32), v_full)
  mixed = jnp.concatenate([out_value.astype(jnp.float32), out_masked, out_qk], axis=-1)
  return mixed.reshape(B, S, 3 * H * D) @ params["wo"]


def loss_fn(params, batch, rng, **kw):
  x, y, pad_mask = batch
  return jnp.mean((model(params, x, pad_mask, rng, **kw) - y) ** 2)


def main(argv=None):
  argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split())).parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  interpret = not on_gpu
  print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}); Pallas kernels "
        f"{'compiled' if on_gpu else 'in interpret mode'}")
  key = jax.random.key(0)
  params = init(key)
  kx, ky, km = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(kx, (B, S, E))
  y = jax.random.normal(ky, (B, S, E))
  lengths = jnp.array([S, S - 7])  # the second sequence is padded
  pad_mask = (jnp.arange(S)[None, :] < lengths[:, None])[:, None, None, :].repeat(S, axis=2)
  batch = (x, y, pad_mask)

  steps = {}
  for impl in ("pallas", "xla"):
    grad_fn = jax.value_and_grad(functools.partial(loss_fn, implementation=impl,
                                                   interpret=interpret))

    @jax.jit
    def train_step(params, batch, rng, grad_fn=grad_fn):
      loss, grads = grad_fn(params, batch, rng)
      return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), loss, grads
    steps[impl] = train_step

  rng = jax.random.key(2)
  _, loss_p, grads_p = steps["pallas"](params, batch, rng)
  _, loss_x, grads_x = steps["xla"](params, batch, rng)
  print(f"loss  pallas {float(loss_p):.6f}   xla reference {float(loss_x):.6f}")
  worst = 0.0
  for name in sorted(grads_p):
    gp, gx = grads_p[name], grads_x[name]
    rel = float(jnp.linalg.norm(gp - gx) / jnp.linalg.norm(gx))
    worst = max(worst, rel)
    print(f"grad {name}: relative difference {rel:.2e}")
  agree = worst < 2e-2  # bf16 paths: gradients agree to bf16 precision
  print(f"gradients agree with the references: {agree} (worst relative difference {worst:.2e})")

  for impl, step in steps.items():
    p = params
    start = time.perf_counter()
    for i in range(20):
      p, loss, _ = step(p, batch, jax.random.fold_in(rng, i))
      if i in (0, 19):
        print(f"{impl:>6} step {i:2d}: loss {float(loss):.4f}")
    jax.block_until_ready(p)
    # Off a GPU only the Pallas path runs in the interpreter; XLA's is compiled for the CPU.
    note = "" if on_gpu or impl == "xla" else "; Pallas interpreter: not a speed measurement"
    print(f"{impl:>6}: {(time.perf_counter() - start) / 20 * 1e3:.1f} ms/step (wall clock, "
          f"jit-compiled step{note})")
  return 0 if agree else 1


if __name__ == "__main__":
  sys.exit(main())
