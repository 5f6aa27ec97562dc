"""The workloads' inputs (``pallas_kernels.workloads``, which the check and the benchmarks
share) meet the preconditions the kernels document, and their floors count the minimum bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import run as bench
from pallas_kernels import workloads


def test_attention_inputs_meet_precondition():
  """``Pd == bf16(P * keep / (1 - p))`` bit for bit, with P the bf16 softmax. (Without a
  barrier, XLA on a GPU made Pd from the unrounded fp32 softmax: 24% of Pd missed by
  an ulp. The CPU backend keeps the rounding either way; the GPU run is the real check.)"""
  p = 0.1
  d_o, probs, dropped, value, keep = workloads.attention_inputs((1, 4, 2, 64, 96, 16), p,
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
  gen = jax.make_jaxpr(lambda key: workloads.attention_inputs((1, 2, 1, 3, 8, 16), 0.1, key))(
      jax.random.key(0))
  assert "optimization_barrier" in str(gen)


def test_causal_floor_counts_the_elements_on_and_below_the_diagonal():
  """The causal table's floor reads g and P only where a causal P may be non-zero."""
  import numpy as np
  for sq, sk in [(1, 1), (5, 5), (3, 7), (7, 3), (211, 211)]:
    brute = int(np.sum(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)))
    assert workloads.causal_elements(sq, sk) == brute, (sq, sk)
  w = {"batch_size": 2, "seq_len_q": 8, "seq_len_k": 8}
  c = {"num_heads": 3, "head_dim": 4}
  qkd = 2 * 2 * 2 * 3 * (8 + 8) * 4
  assert workloads.qk_floor(w, c) == 4 * 2 * 3 * 64 + qkd
  assert workloads.qk_floor(w, c, causal=True) == 4 * 2 * 3 * 36 + qkd


def test_the_benchmarks_use_the_packages_workloads():
  """benchmarks/run.py defines no problem of its own: its inputs, floors and labels are the
  package's, and the workloads file lives in the package."""
  import os
  assert not os.path.exists(os.path.join(bench.HERE, "workloads.json"))
  w = {"batch_size": 2, "n_heads": 3, "seq_len": 8, "p_dropout": 0.1}
  assert bench.PROBLEM_MASKED.floor_bytes(w, {}) == workloads.masked_floor(w, {})
  assert bench.PROBLEM_MASKED.label(w) == workloads.label("masked_softmax_dropout", w)
  causal = bench.problem_of("qk_scale_softmax_causal")
  assert causal.causal and causal.label({"batch_size": 1, "seq_len_q": 4, "seq_len_k": 4}) == (
      "1, 4, 4 causal")
  assert bench.check is workloads.check


def test_from_delta_inputs_add_the_fp32_output():
  """The from-delta problem's inputs: the entry point's, plus ``O = Pd @ V`` in fp32,
  ``[B, Sq, H, D]``."""
  args = bench._from_delta_inputs((1, 4, 2, 32, 48, 16), 0.1, jax.random.key(0))
  d_o, probs, dropped, value, keep, out32 = args
  assert out32.shape == d_o.shape and out32.dtype == jnp.float32
  expected = jnp.einsum("bhqs,bhsd->bqhd", dropped.astype(jnp.float32),
                        jnp.repeat(value, 2, axis=1).astype(jnp.float32))
  assert jnp.allclose(out32, expected, rtol=1e-5, atol=1e-5)


def test_the_softmax_inputs_are_those_of_the_rank_4_formula():
  """The generators make the softmax as a 2D array (it compiles faster on a GPU); its values
  are the rank-4 formula's, causal mask included."""
  key = jax.random.key(5)
  for shape, causal in (((2, 3, 5, 7), False), ((2, 3, 5, 7), True), ((1, 2, 4, 9), True)):
    logits = jax.random.normal(key, shape, jnp.float32)
    if causal:
      sq, sk = shape[-2:]
      below = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
      logits = jnp.where(below, logits, -jnp.inf)
    expected = jax.nn.softmax(logits, axis=-1).astype(jnp.bfloat16)
    got = workloads._softmax(key, shape, jnp.bfloat16, causal)
    assert got.shape == shape and bool(jnp.all(got == expected)), (shape, causal)
  _, _, _, probs = workloads.qk_inputs((1, 2, 6, 8, 16), True, key)
  assert bool(jnp.all(jnp.triu(probs[0, 0].astype(jnp.float32), k=3) == 0))
  assert bool(jnp.all(jnp.diagonal(probs[0, 0], offset=2) != 0))
