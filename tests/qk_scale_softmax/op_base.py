"""The qk_scale_softmax tests, written once and run for every backend (fixture ``implementation``, set by
each ``test_op_<backend>.py``). A backend that takes fewer shapes sets ``GRAD_CASES`` (and
``CAUSAL``) in its test module."""

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


GRAD_CASES = [(2, 3, 7, 7, 16), (1, 2, 5, 33, 64), (1, 1, 17, 17, 40)]  # (B, H, Sq, Sk, D)
CAUSAL = [False, True]


def pytest_generate_tests(metafunc):
  """``grad_case`` and ``causal`` take the test module's ``GRAD_CASES`` and ``CAUSAL``."""
  if "grad_case" in metafunc.fixturenames:
    metafunc.parametrize("grad_case", getattr(metafunc.module, "GRAD_CASES", GRAD_CASES))
  if "causal" in metafunc.fixturenames:
    metafunc.parametrize("causal", getattr(metafunc.module, "CAUSAL", CAUSAL))


def test_grad_matches_autodiff(implementation, causal, grad_case):
  b, h, sq, sk, d = grad_case
  k = keys(2, 3)
  query = jax.random.normal(k[0], (b, h, sq, d), jnp.bfloat16)
  key = jax.random.normal(k[1], (b, h, sk, d), jnp.bfloat16)
  ct = jax.random.normal(k[2], (b, h, sq, sk), jnp.bfloat16)
  op = lambda q, kk: jax_ops.qk_scale_softmax(q, kk, causal=causal, implementation=implementation,
                                              interpret=INTERPRET)
  plain = lambda q, kk: reference.qk_scale_softmax_forward(
      q.astype(F32), kk.astype(F32), d ** -0.5, causal)
  out, (g_q, g_k) = _vjp(jax.jit(op), (query, key), ct)
  ref_out, (r_q, r_k) = _vjp(plain, (query, key), ct.astype(F32))
  assert_close(out, ref_out, atol=1e-5, rtol=1e-2, name="probs")  # ~2 bf16 ulps
  if causal:
    assert bool(jnp.all(jnp.where(reference.causal_mask(sq, sk), 0, out) == 0))
  assert_close(g_q, r_q, atol=1e-2 * float(jnp.abs(r_q).max()), rtol=5e-2, name="d_query")
  assert_close(g_k, r_k, atol=1e-2 * float(jnp.abs(r_k).max()), rtol=5e-2, name="d_key")
