"""The differentiable op B: ``dropout(softmax(scores.masked_fill(~mask, -1e4)))``.

The forward is plain jnp (:mod:`jax_ops.masked_softmax.reference`); the backward is the
backend that :func:`jax_ops.registry.resolve` picks. Residuals: P, the attention mask and
the keep mask (the reference backward's arguments).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_ops import _common
from jax_ops.backend import INPUTS
from jax_ops.masked_softmax import reference
from pallas_kernels import validation

OP = "masked_softmax_dropout"


def masked_softmax_dropout(scores, mask, *, dropout_rate=0.0, dropout_rng=None,
                           implementation: str | None = None, interpret: bool = False):
  """``dropout(softmax(scores.masked_fill(~mask, -1e4)))``.

  Args:
    scores: ``[B, H, Sq, Sk]`` float (fp32 in the usual case; bf16 and fp16 work too).
    mask: ``[B, 1, Sq, Sk]`` bool, True = attend; broadcast over the heads.
    dropout_rate: in [0, 1); 0 means no dropout. A Python float or a traced scalar.
    dropout_rng: a PRNG key; needed when ``dropout_rate`` may be > 0.
    implementation: ``None`` (the fastest backend for the device), ``"pallas"``,
      ``"triton"``, ``"xla"`` or a registered name: the backward pass.
    interpret: run Pallas kernels in the interpreter (for CPU).

  Returns:
    ``[B, H, Sq, Sk]`` in the dtype of ``scores`` (softmax computed in fp32).
  """
  validation.check_scores_and_mask(scores, mask, dtypes=_common.FLOATS)
  keep, p_static, rate = _common.op_dropout(dropout_rng, dropout_rate, scores.shape)
  backend, _ = _common.backend_for(OP, implementation, interpret, (INPUTS,), scores=scores,
                                   mask=mask)
  return _op(scores, mask, keep, rate, p_static, backend, bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _op(scores, mask, keep, rate, p_static, backend, interpret):
  return reference.masked_softmax_dropout_forward(scores, mask, keep, rate)[0]


def _fwd(scores, mask, keep, rate, p_static, backend, interpret):
  out, probs = reference.masked_softmax_dropout_forward(scores, mask, keep, rate)
  return out, (probs, mask, keep, rate)


def _bwd(p_static, backend, interpret, res, grad_out):
  probs, mask, keep, rate = res
  d_scores = backend.backward(grad_out, probs, mask, keep,
                              _common.rate_for_backward(keep, p_static, rate),
                              causal=False, interpret=interpret)
  return d_scores, None, None, jnp.zeros_like(rate)


_op.defvjp(_fwd, _bwd)
