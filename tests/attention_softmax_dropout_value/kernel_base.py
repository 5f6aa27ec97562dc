"""Kernel tests of the attention softmax-dropout-value backward, written once for every backend.

Each ``test_<backend>.py`` defines the fixtures ``backward`` (a callable with the signature of
``pallas_kernels.attention_softmax_dropout_value_backward``: the six positional arguments,
keywords ``delta``, ``causal`` and ``interpret``) and ``backward_from_delta`` (that of
``..._backward_from_delta``: five positional arguments and ``delta``, keywords ``causal`` and
``interpret``), then imports this module's tests with ``from .kernel_base import *``. The tests
use nothing else of a backend: numbers against the jnp reference on odd shapes (interpret
mode off a GPU: sizes are small, the interpreter is slow), dtypes, dropout modes, argument
errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET
from jax_ops.reference import attention_softmax_dropout_value_backward_reference as _reference


def make_inputs(b, h, kvh, sq, skv, d, p, *, dtype=jnp.bfloat16, seed=0, causal=False):
  """Inputs as a real forward makes them: Pd == round(P * keep / (1 - p)). ``causal``: P is
  zero above the diagonal (key ``k > q + skv - sq``).

  Built with NumPy: eager jax.random ops would each compile, which dominates on CPU.
  """
  rng = np.random.default_rng(seed)
  logits = 2.0 * rng.standard_normal((b, h, sq, skv), np.float32)
  if causal:
    above = np.arange(skv)[None, :] > np.arange(sq)[:, None] + (skv - sq)
    logits = np.where(above, -np.inf, logits)
  e = np.exp(logits - logits.max(-1, keepdims=True))
  probs = jnp.asarray(e / e.sum(-1, keepdims=True)).astype(dtype)
  keep = rng.uniform(size=(b, h, sq, skv)) > p
  dropped = (np.asarray(probs, np.float32) * keep / np.float32(1.0 - p)).astype(np.float32)
  grad_out = jnp.asarray(rng.standard_normal((b, sq, h, d), np.float32)).astype(dtype)
  value = jnp.asarray(rng.standard_normal((b, kvh, skv, d), np.float32)).astype(dtype)
  return grad_out, probs, jnp.asarray(dropped).astype(dtype), value, jnp.asarray(keep)


def garbage_mask(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).uniform(size=shape) > 0.5)


# Jitted so each shape compiles once instead of op by op.
reference = jax.jit(_reference, static_argnums=5)


def assert_close_fraction(out, ref, atol, rtol, frac=0.99):
  """``|out - ref| <= atol + rtol * |ref|`` on at least ``frac`` of the elements; finite."""
  out = np.asarray(jnp.asarray(out, jnp.float32))
  ref = np.asarray(jnp.asarray(ref, jnp.float32))
  assert out.shape == ref.shape, (out.shape, ref.shape)
  assert np.all(np.isfinite(out)), "non-finite values in the kernel output"
  ok = np.abs(out - ref) <= atol + rtol * np.abs(ref)
  assert ok.mean() >= frac, (
      f"only {ok.mean():.4f} of elements within atol={atol} rtol={rtol}; "
      f"max abs err {np.abs(out - ref).max()}")


def assert_max_error(out, ref, rel):
  """Stricter: the largest absolute error is small relative to the scale of ``ref``."""
  out = np.asarray(jnp.asarray(out, jnp.float32))
  ref = np.asarray(jnp.asarray(ref, jnp.float32))
  err = np.abs(out - ref).max()
  scale = np.abs(ref).max()
  assert err <= rel * scale + 1e-6, f"max abs err {err} vs ref scale {scale}"


def check(outs, refs, dtype=jnp.bfloat16):
  # bf16 ulp is 2^-8 relative: a one-ulp rounding difference at the largest value is
  # below 1% of the scale; fp16/fp32 are tighter.
  rel = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}[dtype]
  for name, out, ref in zip(("grad_attn_scores", "grad_value_states"), outs, refs):
    assert out.dtype == ref.dtype == dtype, name
    assert_close_fraction(out, ref, atol=1e-5, rtol=0.05)
    assert_max_error(out, ref, rel)


def delta_of(args):
  """``rowsum(dO * (Pd @ V))`` [B, H, Sq] fp32: what the op gets from its forward's output."""
  d_o, _, dropped, value, _ = args
  b, h, sq, skv = dropped.shape
  kvh = value.shape[1]
  v = jnp.repeat(value.astype(jnp.float32), h // kvh, axis=1)
  out = jnp.einsum("bhqs,bhsd->bqhd", dropped.astype(jnp.float32), v,
                   precision=jax.lax.Precision.HIGHEST)
  return jnp.einsum("bqhd,bqhd->bhq", d_o.astype(jnp.float32), out)


# (B, H, KVH, Sq, Skv, D, p): odd lengths, G in {1, 4, 10}, D in {64, 128, 40}.
CASES = [
    (1, 4, 1, 7, 33, 64, 0.1),      # G = 4
    (2, 2, 2, 33, 7, 128, 0.0),     # G = 1, B = 2
    (1, 10, 1, 131, 1, 64, 0.0),    # G = 10, Skv = 1 (p > 0: see test_single_key_dropout)
    (1, 20, 2, 1, 131, 40, 0.1),    # G = 10, Sq = 1, odd D
    (1, 4, 1, 131, 131, 40, 0.1),   # odd D, ragged tails on both axes
    (1, 4, 2, 33, 131, 128, 0.1),   # G = 2, D = 128
]


@pytest.mark.parametrize("b,h,kvh,sq,skv,d,p", CASES)
def test_matches_reference(backward, b, h, kvh, sq, skv, d, p):
  args = make_inputs(b, h, kvh, sq, skv, d, p)
  check(backward(*args, p, interpret=INTERPRET), reference(*args, p))


def test_single_key_dropout(backward):
  """Skv = 1 with dropout: the exact dS is 0 (P == 1, delta == dW). A row that fits one kv
  tile gets delta = rowsum(dW * P) as the reference computes it, so the kernel gives 0 too."""
  p = 0.1
  args = make_inputs(1, 10, 1, 131, 1, 64, p, seed=5)
  ds, dv = backward(*args, p, interpret=INTERPRET)
  ref_ds, ref_dv = reference(*args, p)
  np.testing.assert_allclose(np.asarray(dv, np.float32), np.asarray(ref_dv, np.float32),
                             rtol=1e-2, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(ds, np.float32), np.asarray(ref_ds, np.float32))


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_short_rows_exact_delta(backward, p):
  """Short rows (one kv tile): delta from dW and P exactly as the reference, not from pass
  1's partials of dPd * Pd (whose rounding of Pd alone left 98.65% of this case within the
  tolerance, under the 99% bar)."""
  args = make_inputs(1, 4, 2, 16, 15, 16, p, seed=1)
  check(backward(*args, p, interpret=INTERPRET), reference(*args, p))


def test_p_zero_never_reads_mask(backward):
  """With p == 0 the mask content is irrelevant: garbage gives bit-identical results."""
  args = make_inputs(1, 4, 1, 33, 33, 64, 0.0, seed=2)
  garbage = garbage_mask(args[4].shape, 7)
  a = backward(*args[:4], garbage, 0.0, interpret=INTERPRET)
  b = backward(*args[:4], jnp.zeros_like(args[4]), 0.0, interpret=INTERPRET)
  c = backward(*args, 0.0, interpret=INTERPRET)
  for x, y, z in zip(a, b, c):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(z, np.float32))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(z, np.float32))
  check(a, reference(*args, 0.0))


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_traced_dropout_rate(backward, p):
  """p as a jit argument: the mask is read, scaled by 1/(1-p), and ignored when p == 0."""
  args = make_inputs(1, 4, 2, 33, 40, 64, p, seed=3)
  mask = args[4]
  if p == 0.0:  # p == 0 must ignore the mask even when traced
    mask = garbage_mask(mask.shape, 8)
  fn = jax.jit(lambda rate: backward(*args[:4], mask, rate, interpret=INTERPRET))
  outs = fn(jnp.float32(p))
  check(outs, reference(*args, p))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_other_dtypes(backward, dtype):
  args = make_inputs(1, 4, 2, 20, 37, 64, 0.1, dtype=dtype, seed=4)
  check(backward(*args, 0.1, interpret=INTERPRET), reference(*args, 0.1), dtype)


def test_under_x64(backward, backward_from_delta):
  """With 64-bit types enabled, Python ints default to int64: the kernels' index arithmetic
  stays int32 (it used to fail with ``lax.div requires arguments to have the same dtypes``)."""
  with jax.enable_x64(True):
    args = make_inputs(1, 4, 2, 21, 37, 24, 0.1, seed=12)
    ref = reference(*args, 0.1)
    check(backward(*args, 0.1, interpret=True), ref)
    d_o, probs, _, value, keep = args
    check(backward_from_delta(d_o, probs, value, keep, 0.1, delta_of(args), interpret=True),
          ref)


def test_causal_p(backward, backward_from_delta):
  """A causal P (zero above the diagonal) with ``causal=True``: the same math as dense."""
  args = make_inputs(1, 4, 2, 33, 40, 64, 0.1, seed=13, causal=True)
  ref = reference(*args, 0.1)
  check(backward(*args, 0.1, causal=True, interpret=INTERPRET), ref)
  d_o, probs, _, value, keep = args
  check(backward_from_delta(d_o, probs, value, keep, 0.1, delta_of(args), causal=True,
                            interpret=INTERPRET), ref)
  with pytest.raises(TypeError, match="causal"):
    backward(*args, 0.1, causal="yes", interpret=INTERPRET)


def test_argument_errors(backward):
  args = make_inputs(1, 2, 1, 8, 8, 16, 0.1)
  with pytest.raises(ValueError, match="dropout rate"):
    backward(*args, 1.0, interpret=INTERPRET)
  with pytest.raises(TypeError, match="dropout_mask"):
    backward(*args[:4], args[4].astype(jnp.float32), 0.1, interpret=INTERPRET)
  with pytest.raises(ValueError, match="value_states"):
    backward(*args[:3], args[3][:, :, :4], args[4], 0.1, interpret=INTERPRET)


def test_pd_none_is_an_argument_error(backward):
  """Only the backward from delta goes without Pd; the two-kernel one names it."""
  d_o, probs, _, value, keep = make_inputs(1, 4, 2, 8, 16, 16, 0.1)
  with pytest.raises(TypeError, match="attn_weights_dropped"):
    backward(d_o, probs, None, value, keep, 0.1, interpret=INTERPRET)


@pytest.mark.parametrize("b,h,kvh,sq,skv,d,p", CASES)
def test_from_delta_matches_reference(backward_from_delta, b, h, kvh, sq, skv, d, p):
  """One kernel from P, keep and delta (default tiles: short rows take the in-tile delta,
  longer ones the given one); odd shapes, G in {1, 2, 4, 10}."""
  args = make_inputs(b, h, kvh, sq, skv, d, p, seed=2)
  d_o, probs, _, value, keep = args
  outs = backward_from_delta(d_o, probs, value, keep, p, delta_of(args), interpret=INTERPRET)
  check(outs, reference(*args, p))


def test_from_delta_checks_delta(backward_from_delta):
  args = make_inputs(1, 4, 2, 8, 16, 16, 0.1)
  d_o, probs, _, value, keep = args
  with pytest.raises(ValueError, match="delta"):
    backward_from_delta(d_o, probs, value, keep, 0.1, jnp.zeros((1, 4, 9), jnp.float32),
                        interpret=INTERPRET)
  with pytest.raises((ValueError, TypeError), match="delta"):
    backward_from_delta(d_o, probs, value, keep, 0.1, jnp.zeros((1, 4, 8), jnp.bfloat16),
                        interpret=INTERPRET)
