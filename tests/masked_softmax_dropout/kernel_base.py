"""The backward kernel's tests, written once for every backend: a module that runs them
defines the fixture ``backward``, a callable with the signature of
``pallas_kernels.masked_softmax_dropout_backward(grad_output, p_attn, mask, dropout_mask,
p_dropout, *, interpret=False)``. Only that signature is used here: no backend internals."""

import jax
import jax.numpy as jnp
import pytest

from conftest import INTERPRET, assert_close, keys, softmax_probs
from jax_ops import masked_softmax_dropout_backward_reference as reference


def make_inputs(b, h, sq, sk, seed=0, dtype=jnp.float32):
  k = keys(seed, 4)
  probs = softmax_probs(k[0], (b, h, sq, sk), dtype)
  grad = jax.random.normal(k[1], (b, h, sq, sk), dtype)
  mask = jax.random.bernoulli(k[2], 0.5, (b, 1, sq, sk))
  keep = jax.random.bernoulli(k[3], 0.5, (b, h, sq, sk))
  return grad, probs, mask, keep


@pytest.mark.parametrize("b,h,s", [(2, 3, 1), (1, 2, 7), (2, 2, 131), (1, 1, 293), (1, 2, 64)])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_matches_reference(backward, b, h, s, p):
  args = make_inputs(b, h, s, s, seed=s)
  out = backward(*args, p, interpret=INTERPRET)
  ref = reference(*args, p)
  assert out.dtype == jnp.float32 and out.shape == (b, h, s, s)
  assert_close(out, ref, atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(out - ref).max()) < 1e-5


@pytest.mark.parametrize("sq,sk", [(33, 5), (3, 100)])
def test_rectangular(backward, sq, sk):
  args = make_inputs(2, 2, sq, sk, seed=1)
  out = backward(*args, 0.2, interpret=INTERPRET)
  assert_close(out, reference(*args, 0.2), atol=1e-5, rtol=1e-5)


def test_masked_positions_are_exactly_zero(backward):
  grad, probs, mask, keep = make_inputs(1, 2, 9, 9)
  out = backward(grad, probs, mask, keep, 0.1, interpret=INTERPRET)
  assert bool(jnp.all(jnp.where(mask, 0.0, out) == 0.0))


def test_zero_rate_never_reads_dropout_mask(backward):
  grad, probs, mask, keep = make_inputs(1, 2, 9, 9)
  out = backward(grad, probs, mask, None, 0.0, interpret=INTERPRET)
  assert_close(out, reference(grad, probs, mask, keep, 0.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_traced_rate(backward, p):
  grad, probs, mask, keep = make_inputs(1, 2, 9, 17)
  run = jax.jit(lambda rate: backward(grad, probs, mask, keep, rate, interpret=INTERPRET))
  assert_close(run(jnp.float32(p)), reference(grad, probs, mask, keep, p), atol=1e-5, rtol=1e-5)


def test_bfloat16_inputs(backward):
  args = make_inputs(1, 2, 7, 19, dtype=jnp.bfloat16)
  out = backward(*args, 0.1, interpret=INTERPRET)
  assert out.dtype == jnp.bfloat16
  assert_close(out, reference(*args, 0.1), atol=1e-5, rtol=1e-2)  # ~2 bf16 ulps


def test_deterministic(backward):
  args = make_inputs(1, 2, 31, 31)
  a = backward(*args, 0.1, interpret=INTERPRET)
  b = backward(*args, 0.1, interpret=INTERPRET)
  assert bool(jnp.all(a == b))


def test_vmap_over_extra_axis(backward):
  grads, probs, masks, keeps = zip(*(make_inputs(1, 2, 7, 7, seed=i) for i in range(3)))
  stack = lambda xs: jnp.stack(xs)
  out = jax.vmap(lambda g, p, m, k: backward(g, p, m, k, 0.1, interpret=INTERPRET))(
      stack(grads), stack(probs), stack(masks), stack(keeps))
  for i in range(3):
    assert_close(out[i], reference(grads[i], probs[i], masks[i], keeps[i], 0.1),
                 atol=1e-5, rtol=1e-5)


def test_under_x64(backward):
  """With 64-bit types enabled (index arithmetic must stay int32 inside the kernel)."""
  with jax.enable_x64(True):  # (jax.experimental.enable_x64 in older jax)
    args = make_inputs(1, 3, 7, 13, seed=2)
    out = backward(*args, 0.1, interpret=INTERPRET)
    assert out.dtype == jnp.float32
    assert_close(out, reference(*args, 0.1), atol=1e-5, rtol=1e-5)


def test_rejects_bad_arguments(backward):
  grad, probs, mask, keep = make_inputs(1, 2, 3, 3)
  with pytest.raises(ValueError, match=r"dropout_mask: expected \[B, H, Sq, Sk\]"):
    backward(grad, probs, mask, keep[:, :1], 0.1, interpret=INTERPRET)
  with pytest.raises(ValueError, match=r"p_dropout: expected a dropout rate in \[0, 1\)"):
    backward(grad, probs, mask, keep, 1.0, interpret=INTERPRET)
