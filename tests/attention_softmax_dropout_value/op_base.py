"""The op's tests, written once and run for every backend (fixture ``implementation``, set by
each ``test_op_<backend>.py``): gradients against autodiff of the plain fp32 forward, and an
invalid traced rate giving NaN. A backend that takes fewer shapes sets ``GRAD_CASES`` (and
``TRACED_RATE_SHAPE``) in its test module."""

import jax
import jax.numpy as jnp
import pytest

from conftest import INTERPRET, assert_close, keys
import jax_ops
from jax_ops import reference

F32 = jnp.float32


def _vjp(forward, primals, cotangent):
  out, pullback = jax.vjp(forward, *primals)
  return out, pullback(cotangent)


GRAD_CASES = [  # (B, H, KVH, Sq, Skv, D, rate)
    (2, 4, 2, 7, 9, 16, 0.1),
    (1, 10, 1, 5, 33, 64, 0.0),
    (1, 3, 3, 17, 4, 40, 0.2),
]
TRACED_RATE_SHAPE = (1, 2, 1, 4, 5, 8)  # (B, H, KVH, Sq, Skv, D)


def pytest_generate_tests(metafunc):
  """``grad_case`` takes the test module's ``GRAD_CASES``."""
  if "grad_case" in metafunc.fixturenames:
    metafunc.parametrize("grad_case", getattr(metafunc.module, "GRAD_CASES", GRAD_CASES))


def test_grad_matches_autodiff(implementation, grad_case):
  b, h, kvh, sq, skv, d, rate = grad_case
  k = keys(1, 4)
  scores = jax.random.normal(k[0], (b, h, sq, skv), jnp.bfloat16)
  value = jax.random.normal(k[1], (b, kvh, skv, d), jnp.bfloat16)
  ct = jax.random.normal(k[3], (b, sq, h, d), jnp.bfloat16)
  op = lambda s, v: jax_ops.attention_softmax_dropout_value(
      s, v, dropout_rate=rate, dropout_rng=k[2], implementation=implementation,
      interpret=INTERPRET)
  keep = reference.dropout_keep_mask(k[2], rate, scores.shape) if rate else None
  # The plain forward in fp32: autodiff of it is the exact gradient.
  plain = lambda s, v: reference.attention_softmax_dropout_value_forward(
      s.astype(F32), v.astype(F32), keep, rate)[0]
  out, (g_s, g_v) = _vjp(jax.jit(op), (scores, value), ct)
  ref_out, (r_s, r_v) = _vjp(plain, (scores, value), ct.astype(F32))
  assert out.shape == (b, sq, h, d) and out.dtype == jnp.bfloat16
  assert g_s.dtype == jnp.bfloat16 and g_v.dtype == jnp.bfloat16
  assert_close(out, ref_out, atol=1e-2, rtol=2e-2, name="output")
  # bf16 forward residuals against an fp32 forward: compare at bf16 resolution.
  assert_close(g_s, r_s, atol=2e-3 * float(jnp.abs(r_s).max()), rtol=5e-2, name="d_scores")
  assert_close(g_v, r_v, atol=1e-2 * float(jnp.abs(r_v).max()), rtol=5e-2, name="d_value")


@pytest.mark.parametrize("bad", [-0.5, float("nan")])
def test_invalid_traced_rate_gives_nan_everywhere(implementation, bad, request):
  """A traced rate outside [0, 1) cannot raise when the computation runs: the output and
  both gradients are NaN, never the no-dropout gradients."""
  b, h, kvh, sq, skv, d = getattr(request.module, "TRACED_RATE_SHAPE", TRACED_RATE_SHAPE)
  k = keys(9, 3)
  scores = jax.random.normal(k[0], (b, h, sq, skv), jnp.bfloat16)
  value = jax.random.normal(k[1], (b, kvh, skv, d), jnp.bfloat16)
  loss = lambda s, v, p: jnp.sum(jax_ops.attention_softmax_dropout_value(
      s, v, dropout_rate=p, dropout_rng=k[2], implementation=implementation,
      interpret=INTERPRET).astype(F32))
  value_, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(scores, value, bad)
  assert bool(jnp.isnan(value_))
  for g in grads:
    assert bool(jnp.all(jnp.isnan(g.astype(F32)))), g
