"""The op's tests, written once and run for every backend (fixture ``implementation``, set by
each ``test_op_<backend>.py``)."""

import jax
import jax.numpy as jnp
import pytest

from conftest import INTERPRET, assert_close, exact_jit, keys
import jax_ops
from jax_ops import reference

F32 = jnp.float32


def _vjp(forward, primals, cotangent):
  out, pullback = jax.vjp(forward, *primals)
  return out, pullback(cotangent)


@pytest.mark.parametrize("b,h,sq,sk,rate", [(2, 3, 7, 7, 0.1), (1, 2, 13, 5, 0.0)])
def test_grad_matches_autodiff(implementation, b, h, sq, sk, rate):
  k = keys(0, 4)
  scores = jax.random.normal(k[0], (b, h, sq, sk), F32)
  mask = jax.random.bernoulli(k[1], 0.7, (b, 1, sq, sk))
  ct = jax.random.normal(k[3], (b, h, sq, sk), F32)
  op = lambda s: jax_ops.masked_softmax_dropout(
      s, mask, dropout_rate=rate, dropout_rng=k[2], implementation=implementation,
      interpret=INTERPRET)
  keep = reference.dropout_keep_mask(k[2], rate, scores.shape) if rate else None
  rate_drawn = reference.effective_dropout_rate(rate)   # the ops scale by the rate drawn
  plain = lambda s: reference.masked_softmax_dropout_forward(s, mask, keep, rate_drawn)[0]
  out, (grad,) = _vjp(jax.jit(op), (scores,), ct)
  ref_out, (ref_grad,) = _vjp(plain, (scores,), ct)
  assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
  assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


def test_traced_rate_under_jit(implementation):
  k = keys(4, 3)
  scores = jax.random.normal(k[0], (1, 2, 6, 6))
  mask = jax.random.bernoulli(k[1], 0.7, (1, 1, 6, 6))
  grad_at = lambda rate: jax.grad(lambda s: jnp.sum(jax_ops.masked_softmax_dropout(
      s, mask, dropout_rate=rate, dropout_rng=k[2], implementation=implementation,
      interpret=INTERPRET) ** 2))(scores)
  for rate in (0.0, 0.25):
    keep = reference.dropout_keep_mask(k[2], rate, scores.shape) if rate else None
    want = jax.grad(lambda s: jnp.sum(
        reference.masked_softmax_dropout_forward(s, mask, keep, rate)[0] ** 2))(scores)
    assert_close(jax.jit(grad_at)(jnp.float32(rate)), want, atol=1e-5, rtol=1e-5)


# 1.0 is the boundary of the valid range; values above it take the same check.
@pytest.mark.parametrize("bad", [-0.5, 1.0, float("nan")])
def test_invalid_traced_rate_gives_nan(implementation, bad):
  """A traced rate's value is unknown at trace time and cannot raise when the computation
  runs: an invalid one makes the op's output and gradient NaN everywhere (jit, grad, vmap
  with one bad rate in the batch), never mis-scaled or no-dropout values; a valid traced
  rate works under jax.checkpoint as well."""
  k = keys(5, 3)
  scores = jax.random.normal(k[0], (1, 2, 4, 5))
  mask = jax.random.bernoulli(k[2], 0.7, (1, 1, 4, 5))
  op = lambda s, p: jax_ops.masked_softmax_dropout(s, mask, dropout_rate=p, dropout_rng=k[1],
                                                   implementation=implementation,
                                                   interpret=INTERPRET)
  loss = lambda s, p: op(s, p).sum()
  assert bool(jnp.all(jnp.isnan(jax.jit(op)(scores, bad))))
  assert bool(jnp.all(jnp.isnan(jax.jit(jax.grad(loss))(scores, bad))))
  both = jax.vmap(op, (None, 0))(scores, jnp.array([0.1, bad]))
  assert bool(jnp.all(jnp.isfinite(both[0]))) and bool(jnp.all(jnp.isnan(both[1])))
  ok = jax.jit(jax.grad(jax.checkpoint(loss)))(scores, 0.25)
  want = jax.grad(loss)(scores, 0.25)
  assert_close(ok, want, atol=1e-6, rtol=1e-6)


# Masks that broadcast to [B, 1, Sq, Sk] = [2, 1, 5, 9]: padding, causal, one for all
# batch entries, whole rows, one row of keys, rank 3.
BROADCAST_MASKS = [(2, 1, 1, 9), (5, 9), (1, 1, 5, 9), (2, 1, 5, 1), (9,), (1, 5, 9)]


@pytest.mark.parametrize("shape", BROADCAST_MASKS, ids=str)
def test_broadcast_mask_equals_the_explicit_broadcast(implementation, shape):
  """Values and gradients under jit equal the explicitly broadcast mask's bit for bit,
  and jnp autodiff of the plain forward to rounding."""
  b, h, sq, sk = 2, 3, 5, 9
  k = keys(8, 4)
  scores = 4 * jax.random.normal(k[0], (b, h, sq, sk), F32)
  mask = jax.random.bernoulli(k[1], 0.6, shape)
  full = jnp.broadcast_to(mask, (b, 1, sq, sk))
  ct = jax.random.normal(k[3], (b, h, sq, sk), F32)

  @exact_jit   # bit for bit against another program (conftest.EXACT_COMPILER_OPTIONS)
  def value_and_grad(m):
    return _vjp(lambda s: jax_ops.masked_softmax_dropout(
        s, m, dropout_rate=0.1, dropout_rng=k[2], implementation=implementation,
        interpret=INTERPRET), (scores,), ct)
  got, want = value_and_grad(mask), value_and_grad(full)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape and bool(jnp.array_equal(g, w))
  keep = reference.dropout_keep_mask(k[2], 0.1, scores.shape)
  plain = lambda s: reference.masked_softmax_dropout_forward(
      s, full, keep, reference.effective_dropout_rate(0.1))[0]
  ref_out, (ref_grad,) = _vjp(plain, (scores,), ct)
  assert_close(got[0], ref_out, atol=1e-6, rtol=1e-6)
  assert_close(got[1][0], ref_grad, atol=1e-5, rtol=1e-5)


def test_broadcast_mask_under_vmap(implementation):
  """vmap over a stack of scores sharing one causal mask (the mask not batched), and over
  a stack of padding masks (the mask batched), with the gradient: as the explicit
  broadcast."""
  k = keys(9, 4)
  scores = jax.random.normal(k[0], (2, 1, 2, 6, 6), F32)
  pads = jax.random.bernoulli(k[1], 0.7, (2, 1, 1, 1, 6))
  causal = jax_ops.causal_mask(6, 6)

  def loss(s, m):
    return jnp.sum(jax_ops.masked_softmax_dropout(
        s, m, dropout_rate=0.2, dropout_rng=k[2], implementation=implementation,
        interpret=INTERPRET) * jnp.arange(6.0))
  both = exact_jit(jax.vmap(jax.value_and_grad(loss)))
  shared = exact_jit(jax.vmap(jax.value_and_grad(loss), (0, None)))
  pairs = ((both(scores, pads), both(scores, jnp.broadcast_to(pads, (2, 1, 1, 6, 6)))),
           (shared(scores, causal), shared(scores, jnp.broadcast_to(causal, (1, 1, 6, 6)))))
  for got, want in pairs:
    for g, w in zip(got, want):
      assert bool(jnp.array_equal(g, w))
