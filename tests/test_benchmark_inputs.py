"""The benchmark's problem-A inputs meet the precondition the kernel documents."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import run as bench


def test_a_inputs_meet_precondition():
  """``Pd == bf16(P * keep / (1 - p))`` bit for bit, with P the bf16 softmax. (Without a
  barrier, XLA on a GPU made Pd from the unrounded fp32 softmax: 24% of Pd missed by
  an ulp. The CPU backend keeps the rounding either way; the GPU run is the real check.)"""
  p = 0.1
  d_o, probs, dropped, value, keep = bench._a_inputs((1, 4, 2, 64, 96, 16), p,
                                                     jax.random.key(3))
  assert probs.dtype == dropped.dtype == jnp.bfloat16 and keep.dtype == jnp.bool_
  expected = jax.jit(lambda pr, k: (pr.astype(jnp.float32) * k / (1.0 - p)).astype(
      jnp.bfloat16))(probs, keep)
  assert int(jnp.sum(expected != dropped)) == 0
  assert 0.8 < float(jnp.mean(keep)) < 0.97


def test_pd_is_made_from_the_rounded_p():
  """The ops' forward and the benchmark's generator make Pd from P behind an optimization
  barrier, so XLA cannot make it from the unrounded softmax (the Pallas backward from delta
  rebuilds Pd from P and keep and relies on it; a GPU shows the difference, a CPU does not)."""
  from jax_ops import reference
  s = jnp.zeros((1, 2, 3, 8), jnp.bfloat16)
  v = jnp.zeros((1, 1, 8, 16), jnp.bfloat16)
  keep = jnp.ones((1, 2, 3, 8), bool)
  fwd = jax.make_jaxpr(lambda s, v: reference.attention_softmax_dropout_value_forward(
      s, v, keep, 0.1))(s, v)
  assert "optimization_barrier" in str(fwd)
  gen = jax.make_jaxpr(lambda key: bench._a_inputs((1, 2, 1, 3, 8, 16), 0.1, key))(
      jax.random.key(0))
  assert "optimization_barrier" in str(gen)
