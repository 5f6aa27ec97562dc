"""The op's base suite on the ``"triton"`` backend, and the Triton backend's residual policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, assert_close, keys, pallas_call_outputs
import jax_ops
from jax_ops import reference

from .op_base import *  # noqa: F401,F403
from .op_base import F32, _vjp


@pytest.fixture
def implementation():
  return "triton"


@pytest.mark.parametrize("b,h,kvh,sq,skv,d,rate", [
    (2, 4, 2, 7, 16, 16, 0.1),
    (1, 10, 1, 5, 40, 64, 0.0),
    (1, 4, 2, 9, 80, 40, "traced"),
])
def test_grad_from_saved_output(monkeypatch, b, h, kvh, sq, skv, d, rate):
  """The residual policy "output" (the backward that takes delta from the saved output; the
  op's path on rows of >= 512 aligned keys, the threshold lowered here so small rows take
  it), against autodiff of the fp32 forward; 64-key tiles: rows of 80 keys read the delta
  made from the saved output, shorter ones compute it in the tile."""
  from pallas_kernels.attention_softmax_dropout_value import dispatch
  monkeypatch.setattr(dispatch, "FROM_OUTPUT_MIN_KEYS", 8)
  k = keys(7, 4)
  p = 0.15 if rate == "traced" else rate
  scores = jax.random.normal(k[0], (b, h, sq, skv), jnp.bfloat16)
  value = jax.random.normal(k[1], (b, kvh, skv, d), jnp.bfloat16)
  ct = jax.random.normal(k[3], (b, sq, h, d), jnp.bfloat16)
  op = lambda s, v, r: jax_ops.attention_softmax_dropout_value(
      s, v, dropout_rate=r, dropout_rng=k[2], implementation="triton", interpret=INTERPRET)
  if rate == "traced":
    backward = lambda s, v, r: jax.vjp(lambda s, v: op(s, v, r), s, v)[1](ct)
    args = (scores, value, jnp.float32(p))
  else:
    backward = lambda s, v: jax.vjp(lambda s, v: op(s, v, p), s, v)[1](ct)
    args = (scores, value)
  assert "attention_dropout_value_bwd_ds_dv" in str(jax.make_jaxpr(backward)(*args))
  g_s, g_v = jax.jit(backward)(*args)
  keep = reference.dropout_keep_mask(k[2], p, scores.shape) if p else None
  plain = lambda s, v: reference.attention_softmax_dropout_value_forward(
      s.astype(F32), v.astype(F32), keep, p)[0]
  _, (r_s, r_v) = _vjp(plain, (scores, value), ct.astype(F32))
  assert_close(g_s, r_s, atol=2e-3 * float(jnp.abs(r_s).max()), rtol=5e-2, name="d_scores")
  assert_close(g_v, r_v, atol=1e-2 * float(jnp.abs(r_v).max()), rtol=5e-2, name="d_value")


def test_residual_policy_by_row_length():
  """Short or unaligned rows keep the two-kernel backward (from Pd); rows of >= 512 keys
  that are a multiple of 8 take the one from delta."""
  k = keys(8, 2)
  def kernels(skv):
    s = jnp.zeros((1, 2, 3, skv), jnp.bfloat16)
    v = jnp.zeros((1, 1, skv, 16), jnp.bfloat16)
    op = lambda s, v: jax_ops.attention_softmax_dropout_value(
        s, v, dropout_rate=0.1, dropout_rng=k[0], implementation="triton", interpret=INTERPRET)
    ct = jnp.zeros((1, 3, 2, 16), jnp.bfloat16)
    return str(jax.make_jaxpr(lambda s, v: jax.vjp(op, s, v)[1](ct))(s, v))
  for skv, from_delta in ((256, False), (515, False), (512, True)):
    jaxpr = kernels(skv)
    assert ("attention_dropout_value_bwd_ds_dv" in jaxpr) == from_delta, skv
    assert ("attention_dropout_value_bwd_dv" in jaxpr) != from_delta, skv
    # The policy "fused_output": the forward is the fused kernel, which draws the mask.
    assert ("attention_softmax_dropout_value_forward" in jaxpr) == from_delta, skv


@pytest.mark.parametrize("rate", [0.1, 0.0])
def test_fused_forward_equals_the_xla_path(monkeypatch, rate):
  """On the "fused_output" path (threshold lowered) the op's output and gradients agree with
  the XLA path's (jnp forward, the same mask) to bf16 rounding: the kernel's P can be one
  ulp off the jnp softmax's."""
  from pallas_kernels.attention_softmax_dropout_value import dispatch
  monkeypatch.setattr(dispatch, "FROM_OUTPUT_MIN_KEYS", 8)
  k = keys(9, 4)
  scores = jax.random.normal(k[0], (1, 4, 7, 24), jnp.bfloat16)
  value = jax.random.normal(k[1], (1, 2, 24, 16), jnp.bfloat16)
  ct = jax.random.normal(k[3], (1, 7, 4, 16), jnp.bfloat16)
  def run(impl):
    op = lambda s, v: jax_ops.attention_softmax_dropout_value(
        s, v, dropout_rate=rate, dropout_rng=k[2], implementation=impl, interpret=INTERPRET)
    out, pullback = jax.vjp(op, scores, value)
    return (out, *pullback(ct))
  got_all = run("triton")
  for got, want, name in zip(got_all, run("xla"), ("out", "d_scores", "d_value")):
    got, want = got.astype(F32), want.astype(F32)
    assert_close(got, want, atol=2e-2 * float(jnp.abs(want).max()), rtol=5e-2, name=name)
  # Without a gradient the kernel writes O alone, the same O (checks that can fail: the
  # pullback's forward writes O, P, keep and the fp32 O).
  op = lambda s, v: jax_ops.attention_softmax_dropout_value(
      s, v, dropout_rate=rate, dropout_rng=k[2], implementation="triton", interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(op(scores, value).astype(F32)),
                                np.asarray(got_all[0].astype(F32)))
  assert pallas_call_outputs(op, scores, value) == [1]
  assert pallas_call_outputs(lambda s, v: jax.vjp(op, s, v)[0], scores, value) == [
      4 if rate else 3]


def test_residual_policy_of_the_largest_problems():
  """Scores of 2**31 elements or more keep the jnp forward (the fused kernel's offsets are
  int32): policy "output"; below, "fused_output"."""
  from jax_ops.ops.attention_softmax_dropout_value.pallas_triton import BACKEND
  from jax_ops.backend import Problem
  def policy(b, h, s):
    return BACKEND.residual_policy(Problem(
        op="attention_softmax_dropout_value",
        shapes=(("scores", (b, h, s, s)), ("value_states", (b, 8, s, 128))),
        dtype="bfloat16", interpret=True))
  assert policy(2, 80, 2048) == "fused_output"     # 671M elements
  assert policy(8, 80, 2048) == "output"           # 2.7G elements
