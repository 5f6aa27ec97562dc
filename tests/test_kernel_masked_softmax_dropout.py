"""Kernel B (masked softmax -> dropout backward) against the jnp reference."""

import jax
import jax.numpy as jnp
import pytest

from conftest import INTERPRET, assert_close, keys, softmax_probs
from jax_ops import masked_softmax_dropout_backward_reference as reference
from pallas_kernels import masked_softmax_dropout_backward as kernel


def make_inputs(b, h, sq, sk, seed=0, dtype=jnp.float32):
  k = keys(seed, 4)
  probs = softmax_probs(k[0], (b, h, sq, sk), dtype)
  grad = jax.random.normal(k[1], (b, h, sq, sk), dtype)
  mask = jax.random.bernoulli(k[2], 0.5, (b, 1, sq, sk))
  keep = jax.random.bernoulli(k[3], 0.5, (b, h, sq, sk))
  return grad, probs, mask, keep


@pytest.mark.parametrize("b,h,s", [(2, 3, 1), (1, 2, 7), (2, 2, 131), (1, 1, 293), (1, 2, 64)])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_matches_reference(b, h, s, p):
  args = make_inputs(b, h, s, s, seed=s)
  out = kernel(*args, p, interpret=INTERPRET)
  ref = reference(*args, p)
  assert out.dtype == jnp.float32 and out.shape == (b, h, s, s)
  assert_close(out, ref, atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(out - ref).max()) < 1e-5


@pytest.mark.parametrize("sq,sk", [(5, 33), (33, 5)])
@pytest.mark.parametrize("block_rows", [None, 1, 4])
def test_rectangular_and_block_rows(sq, sk, block_rows):
  args = make_inputs(2, 2, sq, sk, seed=1)
  out = kernel(*args, 0.2, block_rows=block_rows, interpret=INTERPRET)
  assert_close(out, reference(*args, 0.2), atol=1e-5, rtol=1e-5)


def test_masked_positions_are_exactly_zero():
  grad, probs, mask, keep = make_inputs(1, 2, 9, 9)
  out = kernel(grad, probs, mask, keep, 0.1, interpret=INTERPRET)
  assert bool(jnp.all(jnp.where(mask, 0.0, out) == 0.0))


def test_zero_rate_never_reads_dropout_mask():
  grad, probs, mask, keep = make_inputs(1, 2, 9, 9)
  out = kernel(grad, probs, mask, None, 0.0, interpret=INTERPRET)
  assert_close(out, reference(grad, probs, mask, keep, 0.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_traced_rate(p):
  grad, probs, mask, keep = make_inputs(1, 2, 9, 17)
  run = jax.jit(lambda rate: kernel(grad, probs, mask, keep, rate, interpret=INTERPRET))
  assert_close(run(jnp.float32(p)), reference(grad, probs, mask, keep, p), atol=1e-5, rtol=1e-5)


def test_bfloat16_inputs():
  args = make_inputs(1, 2, 7, 19, dtype=jnp.bfloat16)
  out = kernel(*args, 0.1, interpret=INTERPRET)
  assert out.dtype == jnp.bfloat16
  assert_close(out, reference(*args, 0.1), atol=1e-2, rtol=1e-2)


def test_deterministic():
  args = make_inputs(1, 2, 31, 31)
  a = kernel(*args, 0.1, interpret=INTERPRET)
  b = kernel(*args, 0.1, interpret=INTERPRET)
  assert bool(jnp.all(a == b))


def test_vmap_over_extra_axis():
  grads, probs, masks, keeps = zip(*(make_inputs(1, 2, 7, 7, seed=i) for i in range(3)))
  stack = lambda xs: jnp.stack(xs)
  out = jax.vmap(lambda g, p, m, k: kernel(g, p, m, k, 0.1, interpret=INTERPRET))(
      stack(grads), stack(probs), stack(masks), stack(keeps))
  for i in range(3):
    assert_close(out[i], reference(grads[i], probs[i], masks[i], keeps[i], 0.1),
                 atol=1e-5, rtol=1e-5)
