"""The differentiable op ``dropout(softmax(scores.masked_fill(~mask, -1e4)))``.

The backward is the backend that :func:`jax_ops.registry.resolve` picks, and that backend's
residual policy says what the forward is and what it saves:

* ``"inputs"`` (the ``"xla"`` backend, registered functions): the forward is plain jnp
  (:mod:`jax_ops.ops.masked_softmax_dropout.reference`), the keep mask drawn by
  :func:`jax_ops.dropout_keep_mask`; residuals: P, the attention mask and the keep mask (the
  reference backward's arguments).
* ``"scores"`` (the ``"triton"`` backend): the forward (``forward_from_scores``, the fused
  kernel, which draws the same keep mask bit for bit) writes only the output; residuals: the
  scores (an input), the attention mask and the key; ``backward_from_scores`` recomputes P
  and redraws the mask.

Both scale by ``1 / (1 - effective rate)`` (the rate rounded to a multiple of ``2**-16``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_ops import _common
from jax_ops.backend import INPUTS, SCORES
from jax_ops.ops.masked_softmax_dropout import reference
from pallas_kernels import validation

OP = "masked_softmax_dropout"


def masked_softmax_dropout(
    scores: jax.typing.ArrayLike, mask: jax.typing.ArrayLike, *,
    dropout_rate: float | jax.typing.ArrayLike = 0.0, dropout_rng: jax.Array | None = None,
    implementation: str | None = None, interpret: bool = False) -> jax.Array:
  """``dropout(softmax(scores.masked_fill(~mask, -1e4)))``.

  Masked logits are filled with -1e4, not -inf (as the eager PyTorch forward does), so a
  row whose attended logits all lie below -1e4 puts more weight on its masked keys than on
  its attended ones, and a fully masked row is uniform over all its keys.

  The mask may be any bool array that broadcasts to ``[B, 1, Sq, Sk]`` under numpy rules:
  rank <= 4 and each dimension, aligned right, 1 or that size (the head dimension 1):
  ``[B, 1, 1, Sk]`` (padding), ``[Sq, Sk]`` (causal), ``[1, 1, Sq, Sk]``, ``[B, 1, Sq, 1]``,
  ``[Sk]``. The broadcast is never materialized: the kernels read the mask through its own
  shape (a padding mask costs ``Sk`` bytes per batch entry), XLA broadcasts it in its
  fusion, and the forward saves it as given. The results equal those of the explicitly
  broadcast mask bit for bit. Other shapes raise ``ValueError`` naming ``mask``.

  Args:
    scores: ``[B, H, Sq, Sk]`` float (fp32 in the usual case; bf16 and fp16 work too).
    mask: bool, True = attend: ``[B, 1, Sq, Sk]`` or a shape that broadcasts to it (see
      above); one mask for all heads.
    dropout_rate: in [0, 1); 0 means no dropout. A Python float or a traced scalar.
    dropout_rng: a PRNG key, typed (``jax.random.key``) or a legacy ``uint32`` key
      (``jax.random.PRNGKey``); needed when ``dropout_rate`` may be > 0.
    implementation: ``None`` (the fastest backend for the device), ``"pallas"``,
      ``"triton"``, ``"xla"`` or a registered name: the backward pass (and, for the
      ``"triton"`` backend, the forward: its fused kernel).
    interpret: run Pallas kernels in the interpreter (for CPU).

  Returns:
    ``[B, H, Sq, Sk]`` in the dtype of ``scores`` (softmax computed in fp32).
  """
  scores, mask = validation.as_jax(scores, mask)
  validation.check_scores_and_mask(scores, mask, dtypes=_common.FLOATS)
  # The rate and the key are checked before the backend is picked (the same errors on
  # every path); the rates are the effective ones, which the mask draws.
  p_static, rate = _common.op_dropout_rate(dropout_rng, dropout_rate)
  backend, policy = _common.backend_for(OP, implementation, interpret, (INPUTS, SCORES),
                                        scores=scores, mask=mask)
  # Under "scores" the backend draws the mask itself, in its forward and backward.
  keep, rng = _common.op_keep_or_key(dropout_rng, p_static, rate, scores.shape,
                                     backend_draws=policy == SCORES)
  return _op(scores, mask, keep, rng, rate, p_static, backend, policy, bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _op(scores, mask, keep, rng, rate, p_static, backend, policy, interpret):
  return _forward(scores, mask, keep, rng, rate, p_static, backend, policy, interpret)[0]


def _forward(scores, mask, keep, rng, rate, p_static, backend, policy, interpret):
  """``(y, P)``: the backend's fused forward under the ``"scores"`` policy (``(y, None)``),
  else jnp."""
  if policy == SCORES:
    return backend.forward_from_scores(scores, mask, rng, _common.known_rate(p_static, rate),
                                       interpret=interpret), None
  return reference.masked_softmax_dropout_forward(scores, mask, keep, rate)


def _fwd(scores, mask, keep, rng, rate, p_static, backend, policy, interpret):
  scores = _common.first_order_only(backend, scores)
  out, probs = _forward(scores, mask, keep, rng, rate, p_static, backend, policy, interpret)
  # One of keep (policy "inputs") and rng (policy "scores") is saved; both are None
  # without dropout. Under "scores" the scores stand where P stands under "inputs".
  if policy == SCORES:
    probs = scores
  return out, (probs, mask, keep, rng, rate)


def _bwd(p_static, backend, policy, interpret, res, grad_out):
  res, grad_out = _common.first_order_only(backend, (res, grad_out))
  probs, mask, keep, rng, rate = res
  if policy == SCORES:   # ``probs`` holds the scores
    d_scores = backend.backward_from_scores(grad_out, probs, mask, rng,
                                            _common.known_rate(p_static, rate),
                                            causal=False, interpret=interpret)
  else:
    d_scores = backend.backward(grad_out, probs, mask, keep,
                                _common.rate_for_backward(keep, p_static, rate),
                                causal=False, interpret=interpret)
  # probs has the scores' shape and dtype (under "scores" it is the scores).
  (d_scores,) = _common.checked_grads(backend, (d_scores,), (probs,), ("scores",))
  # mask, keep and the key are not differentiable (None: no cotangent); the rate's is zero.
  return d_scores, None, None, None, jnp.zeros_like(rate)


_op.defvjp(_fwd, _bwd)
