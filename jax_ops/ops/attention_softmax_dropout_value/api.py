"""The differentiable op: ``transpose(dropout(softmax(scores)) @ V)`` with GQA value heads.

The backward is the backend that :func:`jax_ops.registry.resolve` picks, and that backend's
residual policy says what the forward is and what it saves: ``"inputs"`` (a jnp forward,
:mod:`jax_ops.ops.attention_softmax_dropout_value.reference`, the keep mask drawn by
:func:`jax_ops.dropout_keep_mask`; P, Pd, V and the keep mask, the reference backward's
arguments), ``"fused_inputs"`` (P, Pd and V from the backend's fused forward kernel,
``forward_with_dropped``, which draws the same keep mask itself and does not store it: for
kernels that do not read keep; a traced rate runs ``"inputs"``), ``"output"`` (the jnp
forward; P, V, keep and the fp32 output O, for a backward that takes
``delta = rowsum(dO * O)``) or ``"fused_output"`` (what ``"output"`` saves, from the
backend's fused forward kernel, ``forward_with_output``, which draws the same keep mask
itself).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_ops import _common
from jax_ops.ops.attention_softmax_dropout_value import reference
from jax_ops.backend import FUSED_INPUTS, FUSED_OUTPUT, INPUTS, OUTPUT
from pallas_kernels import validation
from pallas_kernels.attention_softmax_dropout_value import dispatch

OP = "attention_softmax_dropout_value"


def attention_softmax_dropout_value(
    scores: jax.typing.ArrayLike, value_states: jax.typing.ArrayLike, *,
    dropout_rate: float | jax.typing.ArrayLike = 0.0, dropout_rng: jax.Array | None = None,
    implementation: str | None = None, interpret: bool = False) -> jax.Array:
  """``transpose(dropout(softmax(scores)) @ V)`` with grouped-query value heads.

  Args:
    scores: ``[B, H, Sq, Skv]`` attention logits (bf16 in the usual case; fp16
      and fp32 work too).
    value_states: ``[B, KVH, Skv, D]``, same dtype, ``H % KVH == 0``; query head
      ``h`` reads value head ``h // (H // KVH)``.
    dropout_rate: in [0, 1); 0 means no dropout. A Python float or a traced scalar.
    dropout_rng: a PRNG key, typed (``jax.random.key``) or a legacy ``uint32`` key
      (``jax.random.PRNGKey``); needed when ``dropout_rate`` may be > 0.
    implementation: ``None`` (the fastest backend for the device), ``"pallas"``,
      ``"triton"``, ``"mosaic_gpu"``, ``"xla"`` or a registered name: the backward pass,
      and the forward (the Pallas backends run a fused forward kernel where their
      residual policy asks for one, see above; ``"xla"`` jnp).
    interpret: run Pallas kernels in the interpreter (for CPU).

  Returns:
    ``[B, Sq, H, D]`` in the dtype of ``scores``. The softmax runs in fp32 and is
    rounded to the input dtype before dropout and the value matmul (fp32 accumulate).
  """
  scores, value_states = validation.as_jax(scores, value_states)
  validation.check_scores_and_value(scores, value_states, dtypes=_common.FLOATS)
  # The rate and the key are checked before the backend is picked (the same errors on
  # every path); the rates are the effective ones, which the mask draws.
  p_static, rate = _common.op_dropout_rate(dropout_rng, dropout_rate)
  backend, policy = _common.backend_for(OP, implementation, interpret,
                                        (INPUTS, FUSED_INPUTS, OUTPUT, FUSED_OUTPUT),
                                        scores=scores, value_states=value_states)
  policy = dispatch.residuals_at_rate(policy, p_static)
  # Under "fused_inputs" and "fused_output" the backend's forward kernel draws the mask.
  keep, rng = _common.op_keep_or_key(dropout_rng, p_static, rate, scores.shape,
                                     backend_draws=policy in (FUSED_INPUTS, FUSED_OUTPUT))
  return _op(scores, value_states, keep, rng, rate, p_static, backend, policy,
             bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _op(scores, value_states, keep, rng, rate, p_static, backend, policy, interpret):
  if policy in (FUSED_INPUTS, FUSED_OUTPUT):
    # No gradient taken: the backend's fused kernel writes O alone, none of the residuals.
    return backend.forward_output(scores, value_states, rng,
                                  _common.known_rate(p_static, rate), interpret=interpret)
  return _forward(scores, value_states, keep, rng, rate, p_static, backend, policy,
                  interpret)[0]


def _forward(scores, value_states, keep, rng, rate, p_static, backend, policy, interpret):
  """``(O, P, Pd, keep, O_f32)``: the backend's fused forward under ``"fused_inputs"`` (no
  keep, no O_f32) and ``"fused_output"`` (no Pd), else jnp."""
  if policy == FUSED_INPUTS:
    out, probs, dropped = backend.forward_with_dropped(scores, value_states, rng, p_static,
                                                       interpret=interpret)
    return out, probs, dropped, None, None
  if policy == FUSED_OUTPUT:
    out, probs, keep, out32 = backend.forward_with_output(
        scores, value_states, rng, _common.known_rate(p_static, rate), interpret=interpret)
    return out, probs, None, keep, out32
  out, probs, dropped, out32 = reference.attention_softmax_dropout_value_forward(
      scores, value_states, keep, rate, with_f32_output=True)
  return out, probs, dropped, keep, out32


def _fwd(scores, value_states, keep, rng, rate, p_static, backend, policy, interpret):
  scores, value_states = _common.first_order_only(backend, (scores, value_states))
  out, probs, dropped, keep, out32 = _forward(scores, value_states, keep, rng, rate,
                                              p_static, backend, policy, interpret)
  if policy in (OUTPUT, FUSED_OUTPUT):
    return out, (probs, None, value_states, keep, rate, out32)
  return out, (probs, dropped, value_states, keep, rate, None)


def _bwd(p_static, backend, policy, interpret, res, grad_out):
  res, grad_out = _common.first_order_only(backend, (res, grad_out))
  probs, dropped, value_states, keep, rate, out32 = res
  # "fused_inputs" saves no keep (the rate is concrete there); else no keep: no dropout.
  p = p_static if policy == FUSED_INPUTS else _common.rate_for_backward(keep, p_static, rate)
  if policy in (OUTPUT, FUSED_OUTPUT):
    d_scores, d_value = backend.backward_from_output(
        grad_out, probs, value_states, keep, p, out32, causal=False, interpret=interpret)
  else:
    d_scores, d_value = backend.backward(grad_out, probs, dropped, value_states, keep, p,
                                         causal=False, interpret=interpret)
  # probs has the scores' shape (and their dtype, which value_states shares, unless it is the
  # Mosaic GPU backend's fp16 unnormalized softmax).
  like_scores = jax.ShapeDtypeStruct(probs.shape, value_states.dtype)
  d_scores, d_value = _common.checked_grads(backend, (d_scores, d_value),
                                            (like_scores, value_states),
                                            ("scores", "value_states"))
  # keep and the key are not differentiable (None: no cotangent); the rate's is zero.
  return d_scores, d_value, None, None, jnp.zeros_like(rate)


_op.defvjp(_fwd, _bwd)
