"""The differentiable attention ops: plain-jnp forwards with custom backward passes.

Each op is a ``jax.custom_vjp`` whose forward is the plain-jnp forward of
:mod:`jax_ops.reference` and whose backward is picked from
:mod:`jax_ops.registry`: ``implementation=None`` takes the Pallas kernel where
one exists for the device and is measured faster than XLA (today: all three
backward passes), ``"pallas"`` forces the Pallas kernel (with
``interpret=True`` it runs on any backend, slowly), ``"xla"`` takes the jnp
reference.

Dropout: ``dropout_rate == 0`` or ``dropout_rng is None`` means no dropout. The
rate may be a Python float or a traced scalar; the ops are not differentiable
with respect to it (its cotangent is zero). A Python float outside [0, 1) raises at
once; a traced one cannot raise (its value is known only when the computation runs) and
makes the outputs and gradients NaN instead.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_ops import reference, registry
from pallas_kernels import validation as _checks
from pallas_kernels import attention_softmax_dropout_value as asdv_kernels

_FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32)


def _check_rng(rng) -> None:
  """``dropout_rng`` must be one PRNG key (``vmap`` for more): a typed key
  (``jax.random.key``) or a raw ``uint32`` key of the default implementation's shape
  (``jax.random.PRNGKey``: ``[2]`` for threefry)."""
  if hasattr(rng, "dtype") and jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if rng.shape == ():
      return
  elif hasattr(rng, "dtype") and rng.dtype == jnp.uint32:
    if rng.shape == jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape:
      return
  what = f"shape {list(rng.shape)} {rng.dtype}" if hasattr(rng, "dtype") else type(rng).__name__
  raise TypeError("dropout_rng: expected one PRNG key (jax.random.key(seed), or a raw uint32 "
                  f"key from jax.random.PRNGKey) or None, got {what}")


def _dropout(rng, rate, shape):
  """``(keep, rate_static, rate_array)``; ``keep`` is ``None`` when no dropout applies."""
  p_static = _checks.check_dropout_rate("dropout_rate", rate)
  if rng is None or p_static == 0.0:
    return None, 0.0, jnp.zeros((), jnp.float32)
  _check_rng(rng)
  rate = jnp.asarray(rate, jnp.float32)
  if p_static is None:  # traced: an invalid rate makes the outputs NaN, not mis-scaled
    rate = _checks.nan_unless_rate_valid(rate, rate)
  return reference.dropout_keep_mask(rng, rate, shape), p_static, rate


def _rate_for_backward(keep, p_static, rate):
  """What a backward implementation gets as its dropout rate: a float when known."""
  if keep is None:
    return 0.0
  return rate if p_static is None else p_static


# --- A: softmax -> dropout -> GQA value matmul ---------------------------------------------


def attention_softmax_dropout_value(scores, value_states, *, dropout_rate=0.0, dropout_rng=None,
                                    implementation: str | None = None, interpret: bool = False):
  """``transpose(dropout(softmax(scores)) @ V)`` with grouped-query value heads.

  Args:
    scores: ``[B, H, Sq, Skv]`` attention logits (bf16 in the usual case; fp16
      and fp32 work too).
    value_states: ``[B, KVH, Skv, D]``, same dtype, ``H % KVH == 0``; query head
      ``h`` reads value head ``h // (H // KVH)``.
    dropout_rate: in [0, 1).
    dropout_rng: a PRNG key, or ``None`` for no dropout.
    implementation: ``None``, ``"pallas"`` or ``"xla"``: the backward pass.
    interpret: run Pallas kernels in the interpreter (for CPU).

  Returns:
    ``[B, Sq, H, D]`` in the dtype of ``scores``. The softmax runs in fp32 and is
    rounded to the input dtype before dropout and the value matmul (fp32 accumulate).
  """
  _checks.check_array("scores", scores, ("B", "H", "Sq", "Skv"), dtypes=_FLOATS)
  _checks.check_positive("scores", scores, ("B", "H", "Sq", "Skv"))
  b, h, _, skv = scores.shape
  _checks.check_array("value_states", value_states, ("B", "KVH", "Skv", "D"),
                      (b, None, skv, None), dtypes=(scores.dtype,))
  _checks.check_positive("value_states", value_states, ("B", "KVH", "Skv", "D"))
  _checks.check_divisible(h, value_states.shape[1])
  keep, p_static, rate = _dropout(dropout_rng, dropout_rate, scores.shape)
  name, _ = registry.resolve("attention_softmax_dropout_value", implementation, interpret)
  return _asdv(scores, value_states, keep, rate, p_static, name, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _asdv(scores, value_states, keep, rate, p_static, name, interpret):
  return reference.attention_softmax_dropout_value_forward(scores, value_states, keep, rate)[0]


# Rows of at least this many keys (and a multiple of 8) take the Pallas backward from delta.
_FROM_DELTA_MIN_KEYS = 512


def _asdv_from_delta(name, scores, value_states):
  """Whether the backward is the Pallas kernel that takes delta from the forward's output
  (``pallas_kernels.attention_softmax_dropout_value_backward_from_delta``): the forward
  saves O (fp32, ``[B, Sq, H, D]``) instead of Pd, and the backward runs one kernel that
  reads 5 B per attention element instead of two that read 7.

  Measured on an H200 (D = 128,
  ``benchmarks/results/attention_softmax_dropout_value_from_delta.md``): 4-13% faster than
  the two kernels on all 7 workloads with rows of >= 512 keys that are a multiple of 8;
  slower on shorter rows (delta, an ``O(Sq*D)`` pass over dO and O, no longer pays off
  when ``Skv`` is close to D) and 2.3x slower on rows of ``Skv % 8 != 0`` keys (its column
  tiles load them element by element).
  """
  b, h, sq, skv = scores.shape
  d = value_states.shape[3]
  return (name == registry.PALLAS and skv >= _FROM_DELTA_MIN_KEYS and skv % 8 == 0
          and d <= 128  # measured at D = 128; larger D makes delta dearer
          and b * sq * h * d < 2**31)  # int32 offsets


def _asdv_fwd(scores, value_states, keep, rate, p_static, name, interpret):
  out, probs, dropped, out32 = reference.attention_softmax_dropout_value_forward(
      scores, value_states, keep, rate, with_f32_output=True)
  if _asdv_from_delta(name, scores, value_states):
    return out, (probs, None, value_states, keep, rate, out32)
  return out, (probs, dropped, value_states, keep, rate, None)


def _asdv_bwd(p_static, name, interpret, res, grad_out):
  probs, dropped, value_states, keep, rate, out32 = res
  p = _rate_for_backward(keep, p_static, rate)
  if out32 is not None:
    delta = asdv_kernels.delta_from_output(grad_out, out32)
    d_scores, d_value = asdv_kernels.attention_softmax_dropout_value_backward_from_delta(
        grad_out, probs, value_states, keep, p, delta, interpret=interpret)
  else:
    _, backward = registry.resolve("attention_softmax_dropout_value", name, interpret)
    d_scores, d_value = backward(grad_out, probs, dropped, value_states, keep, p)
  return d_scores, d_value, None, jnp.zeros_like(rate)


_asdv.defvjp(_asdv_fwd, _asdv_bwd)


# --- B: masked softmax -> dropout ------------------------------------------------------------


def masked_softmax_dropout(scores, mask, *, dropout_rate=0.0, dropout_rng=None,
                           implementation: str | None = None, interpret: bool = False):
  """``dropout(softmax(scores.masked_fill(~mask, -1e4)))``.

  Args:
    scores: ``[B, H, Sq, Sk]`` float (fp32 in the usual case).
    mask: ``[B, 1, Sq, Sk]`` bool, True = attend; broadcast over the heads.
    dropout_rate: in [0, 1).
    dropout_rng: a PRNG key, or ``None`` for no dropout.
    implementation: ``None``, ``"pallas"`` or ``"xla"``: the backward pass.
    interpret: run Pallas kernels in the interpreter (for CPU).

  Returns:
    ``[B, H, Sq, Sk]`` in the dtype of ``scores`` (softmax computed in fp32).
  """
  _checks.check_array("scores", scores, ("B", "H", "Sq", "Sk"), dtypes=_FLOATS)
  _checks.check_positive("scores", scores, ("B", "H", "Sq", "Sk"))
  b, _, sq, sk = scores.shape
  _checks.check_array("mask", mask, ("B", "1", "Sq", "Sk"), (b, 1, sq, sk), dtypes=(jnp.bool_,))
  keep, p_static, rate = _dropout(dropout_rng, dropout_rate, scores.shape)
  name, _ = registry.resolve("masked_softmax_dropout", implementation, interpret)
  return _msd(scores, mask, keep, rate, p_static, name, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _msd(scores, mask, keep, rate, p_static, name, interpret):
  return reference.masked_softmax_dropout_forward(scores, mask, keep, rate)[0]


def _msd_fwd(scores, mask, keep, rate, p_static, name, interpret):
  out, probs = reference.masked_softmax_dropout_forward(scores, mask, keep, rate)
  return out, (probs, mask, keep, rate)


def _msd_bwd(p_static, name, interpret, res, grad_out):
  probs, mask, keep, rate = res
  _, backward = registry.resolve("masked_softmax_dropout", name, interpret)
  d_scores = backward(grad_out, probs, mask, keep, _rate_for_backward(keep, p_static, rate))
  return d_scores, None, None, jnp.zeros_like(rate)


_msd.defvjp(_msd_fwd, _msd_bwd)


# --- C: QK matmul -> scale -> softmax --------------------------------------------------------


def qk_scale_softmax(query, key, *, scaling: float | None = None, causal: bool = False,
                     implementation: str | None = None, interpret: bool = False):
  """Attention weights ``softmax((Q @ K^T) * scaling)``.

  Args:
    query: ``[B, H, Sq, D]`` (bf16 in the usual case).
    key: ``[B, H, Sk, D]``, same dtype.
    scaling: the logits' scale, a Python float; ``None`` means ``1/sqrt(D)``.
    causal: mask keys ``k > q + (Sk - Sq)`` (needs ``Sq <= Sk``); the Pallas
      backward then skips the tiles above the diagonal.
    implementation: ``None``, ``"pallas"`` or ``"xla"``: the backward pass.
    interpret: run Pallas kernels in the interpreter (for CPU).

  Returns:
    ``[B, H, Sq, Sk]`` in the dtype of ``query`` (fp32 logits and softmax).
  """
  _checks.check_array("query", query, ("B", "H", "Sq", "D"), dtypes=_FLOATS)
  _checks.check_positive("query", query, ("B", "H", "Sq", "D"))
  b, h, sq, d = query.shape
  _checks.check_array("key", key, ("B", "H", "Sk", "D"), (b, h, None, d), dtypes=(query.dtype,))
  _checks.check_positive("key", key, ("B", "H", "Sk", "D"))
  causal = _checks.check_causal(causal, sq, key.shape[2])
  if scaling is None:
    scaling = 1.0 / math.sqrt(d)
  scaling = _checks.check_scaling("scaling", scaling)
  if scaling is None:
    raise TypeError("scaling: expected a Python float (or None for 1/sqrt(D)), got a traced value")
  name, _ = registry.resolve("qk_scale_softmax", implementation, interpret)
  return _qss(query, key, scaling, causal, name, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _qss(query, key, scaling, causal, name, interpret):
  return reference.qk_scale_softmax_forward(query, key, scaling, causal)


def _qss_fwd(query, key, scaling, causal, name, interpret):
  probs = reference.qk_scale_softmax_forward(query, key, scaling, causal)
  return probs, (query, key, probs)


def _qss_bwd(scaling, causal, name, interpret, res, grad_probs):
  query, key, probs = res
  _, backward = registry.resolve("qk_scale_softmax", name, interpret)
  kwargs = {"causal": causal} if name == registry.PALLAS else {}
  return backward(grad_probs, query, key, probs, scaling, **kwargs)


_qss.defvjp(_qss_fwd, _qss_bwd)
