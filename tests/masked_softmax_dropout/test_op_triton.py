"""The op's base suite on the ``"triton"`` backend, and its residual policy ``"scores"``:
the fused forward kernel writes only the output, the forward saves the scores, the
attention mask and the key, and the backward recomputes P and redraws the keep mask; no
keep mask is saved. Values and gradients equal the ``"xla"`` path's (jnp forward, stored
keep) for the same key."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, keys
import jax_ops
from jax_ops import registry
from jax_ops.backend import INPUTS, SCORES, Problem

from .op_base import *  # noqa: F401,F403
from .op_base import F32

OP = "masked_softmax_dropout"


@pytest.fixture
def implementation():
  return "triton"


# P recomputed in the backward, its row sums maybe in another order than the forward's:
# equal to rounding.
TOL = 1e-5


def _op(implementation, mask, rng, **kw):
  return lambda s, rate: jax_ops.masked_softmax_dropout(
      s, mask, dropout_rate=rate, dropout_rng=rng, implementation=implementation,
      interpret=INTERPRET, **kw)


def _inputs(b, h, s, seed=0):
  k = keys(seed, 4)
  scores = jax.random.normal(k[0], (b, h, s, s), F32)
  mask = jax.random.bernoulli(k[1], 0.7, (b, 1, s, s))
  ct = jax.random.normal(k[3], (b, h, s, s), F32)
  return scores, mask, ct, k[2]


def _value_and_grad(implementation, scores, mask, rng, rate, ct, jit_rate=False):
  op = _op(implementation, mask, rng)
  def vjp(s, r):
    out, pullback = jax.vjp(lambda s: op(s, r), s)
    return out, pullback(ct)[0]
  if jit_rate:  # the rate an argument of the jitted function: traced
    return jax.jit(vjp)(scores, jnp.float32(rate))
  return jax.jit(vjp, static_argnums=1)(scores, rate)


def _assert_same(got, want, tol=1e-6):
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


@pytest.mark.parametrize("b,h,s,rate", [(1, 1, 1, 0.1), (2, 3, 7, 0.1), (1, 3, 131, 0.1),
                                        (2, 1, 7, 0.0), (1, 1, 131, 0.0)])
def test_equals_the_xla_path(b, h, s, rate):
  """Forward values and gradients of the Triton path (fused forward; the backward
  recomputing P; the keep mask redrawn from the key) equal the XLA path's (jnp forward, the
  jnp keep mask saved) for the same key."""
  scores, mask, ct, rng = _inputs(b, h, s)
  got = _value_and_grad("triton", scores, mask, rng, rate, ct)
  want = _value_and_grad("xla", scores, mask, rng, rate, ct)
  _assert_same(got, want, TOL)


@pytest.mark.parametrize("rate", [0.1, 0.0])
def test_traced_rate_equals_the_xla_path(rate):
  scores, mask, ct, rng = _inputs(1, 3, 7, seed=1)
  got = _value_and_grad("triton", scores, mask, rng, rate, ct, jit_rate=True)
  want = _value_and_grad("xla", scores, mask, rng, rate, ct, jit_rate=True)
  _assert_same(got, want, TOL)


def test_raw_uint32_key():
  """A raw key (``jax.random.PRNGKey``) draws the typed key's mask on the Triton path too."""
  scores, mask, ct, _ = _inputs(1, 2, 7, seed=2)
  raw, typed = jax.random.PRNGKey(5), jax.random.key(5)
  got = _value_and_grad("triton", scores, mask, raw, 0.2, ct)
  _assert_same(got, _value_and_grad("xla", scores, mask, typed, 0.2, ct), TOL)


def _residuals(implementation, scores, mask, rng, rate):
  """The leaves the pullback of ``jax.vjp`` holds (the custom_vjp residuals)."""
  _, pullback = jax.vjp(lambda s: _op(implementation, mask, rng)(s, rate), scores)
  return jax.tree.leaves(pullback)


def _eqn_outputs(jaxpr):
  """The avals of every equation's outputs, sub-jaxprs included."""
  for eqn in jaxpr.eqns:
    yield from (v.aval for v in eqn.outvars)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _eqn_outputs(sub)


def _eqns(jaxpr):
  """Every equation, sub-jaxprs included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def test_saves_the_key_not_a_keep_mask():
  """The Triton path's residuals: the scores, the attention mask, the key and the
  rate; no bool ``[B, H, S, S]``, and their forwards compute none (no jnp mask drawing).
  The XLA path saves the keep mask (the check can fail)."""
  scores, mask, _, rng = _inputs(2, 3, 7, seed=3)
  full = (2, 3, 7, 7)
  is_keep = lambda a: a.shape == full and a.dtype == jnp.bool_
  for rate in (0.1, "traced"):
    if rate == "traced":
      res = jax.jit(lambda s, r: _residuals("triton", s, mask, rng, r))(scores, 0.1)
    else:
      res = _residuals("triton", scores, mask, rng, rate)
    assert not any(is_keep(r) for r in res), rate
    assert [r.shape for r in res] == [full, (2, 1, 7, 7), (), ()]
    assert jax.dtypes.issubdtype(res[2].dtype, jax.dtypes.prng_key)
  assert any(is_keep(r) for r in _residuals("xla", scores, mask, rng, 0.1))
  # Not drawn either: no equation of the Triton path's forward or gradient makes one.
  for implementation in ("triton", "xla"):
    op = _op(implementation, mask, rng)
    fwd = jax.make_jaxpr(lambda s: jax.vjp(lambda s: op(s, 0.1), s)[0])(scores)
    step = jax.make_jaxpr(jax.grad(lambda s: jnp.sum(op(s, 0.1) ** 2)))(scores)
    for jaxpr in (fwd, step):
      drawn = any(is_keep(a) for a in _eqn_outputs(jaxpr.jaxpr))
      assert drawn == (implementation == "xla"), implementation
  # Without dropout no key is saved (none is needed).
  res = _residuals("triton", scores, mask, None, 0.0)
  assert [r.shape for r in res] == [full, (2, 1, 7, 7), ()]


def test_vmap_over_keys_and_grad():
  """vmap over a batch of keys (and of the op's gradient) equals the XLA path's."""
  scores, mask, _, _ = _inputs(1, 2, 5, seed=4)
  rngs = jax.random.split(jax.random.key(9), 2)
  def per_key(implementation):
    def f(rng):
      op = _op(implementation, mask, rng)
      loss = lambda s: jnp.sum(op(s, 0.3) * jnp.arange(5.0))
      return op(scores, 0.3), jax.grad(loss)(scores)
    return jax.jit(jax.vmap(f))(rngs)
  got, want = per_key("triton"), per_key("xla")
  _assert_same(got, want, TOL)
  assert not np.array_equal(np.asarray(got[0][0]), np.asarray(got[0][1]))  # two masks


def test_residual_policies():
  """``"scores"`` for the Triton backend, ``"inputs"`` for XLA."""
  problem = Problem(op=OP, shapes=(("scores", (2, 3, 7, 7)), ("mask", (2, 1, 7, 7))),
                    dtype="float32", interpret=True)
  assert registry.get(OP, "triton").residual_policy(problem) == SCORES
  assert registry.get(OP, "xla").residual_policy(problem) == INPUTS


def test_errors_on_the_triton_path():
  """Bad dropout arguments raise the op's errors on the Triton path too."""
  scores, mask, _, rng = _inputs(1, 1, 4)
  op = lambda **kw: jax_ops.masked_softmax_dropout(scores, mask, implementation="triton",
                                                   interpret=INTERPRET, **kw)
  with pytest.raises(ValueError, match=r"dropout_rng: dropout_rate=0.1 needs a PRNG key"):
    op(dropout_rate=0.1)
  with pytest.raises(ValueError, match=r"dropout_rng: a traced dropout_rate needs a PRNG key"):
    jax.jit(lambda p: op(dropout_rate=p))(0.1)
  with pytest.raises(TypeError, match="dropout_rng: expected one PRNG key"):
    op(dropout_rate=0.1, dropout_rng=3)
  with pytest.raises(TypeError, match="dropout_rng: expected one PRNG key"):
    op(dropout_rate=0.1, dropout_rng=jax.random.split(rng, 2))
  with pytest.raises(ValueError, match=r"dropout_rate: expected a dropout rate in \[0, 1\)"):
    op(dropout_rate=1.0, dropout_rng=rng)
  with pytest.raises(TypeError, match="mask: expected dtype bool"):
    jax_ops.masked_softmax_dropout(scores, mask.astype(F32), implementation="triton",
                                   interpret=INTERPRET)


# --- What the forward writes and saves -------------------------------------------------

def test_scores_policy_saves_only_the_inputs_and_the_key():
  """The ``"scores"`` policy's residuals are the scores themselves (no P, no keep mask),
  the attention mask, the key and the rate; its forward kernel writes only the output."""
  scores, mask, _, rng = _inputs(2, 3, 7, seed=6)
  res = _residuals("triton", scores, mask, rng, 0.1)
  assert [r.shape for r in res] == [(2, 3, 7, 7), (2, 1, 7, 7), (), ()]
  assert res[0] is scores or np.array_equal(np.asarray(res[0]), np.asarray(scores))
  op = _op("triton", mask, rng)
  fwd = jax.make_jaxpr(lambda s: jax.vjp(lambda s: op(s, 0.1), s)[0])(scores)
  kernels = [e for e in _eqns(fwd.jaxpr) if e.primitive.name == "pallas_call"]
  assert [len(e.outvars) for e in kernels] == [1]


def test_padding_mask_is_never_broadcast():
  """With a ``[B, 1, 1, S]`` padding mask, no equation of the Triton path's forward or
  training step makes a bool array bigger than the mask (the XLA path's keep mask shows
  the check can fail), and the residual is the mask as given."""
  scores, _, _, rng = _inputs(2, 3, 7, seed=7)
  pad = jnp.arange(7)[None, None, None, :] < jnp.array([7, 4])[:, None, None, None]
  def big_bools(jaxpr):   # outside the kernels (whose tiles are bool arrays too)
    for eqn in jaxpr.eqns:
      yield from (v.aval.size > pad.size for v in eqn.outvars if v.aval.dtype == jnp.bool_)
      if eqn.primitive.name != "pallas_call":
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
          yield from big_bools(sub)
  for implementation in ("triton", "xla"):
    op = _op(implementation, pad, rng)
    step = jax.make_jaxpr(jax.grad(lambda s: jnp.sum(op(s, 0.1) ** 2)))(scores)
    assert any(big_bools(step.jaxpr)) == (implementation == "xla")
  assert [r.shape for r in _residuals("triton", scores, pad, rng, 0.1)] == [
      (2, 3, 7, 7), (2, 1, 1, 7), (), ()]
