"""The differentiable qk_scale_softmax: attention weights ``softmax((Q @ K^T) * scaling)``.

The backward is the backend that :func:`jax_ops.registry.resolve` picks, given ``causal`` so
that it may skip the tiles above the diagonal; the forward is that backend's ``forward``
where it has one (the Pallas backends: the fused kernel that
:func:`pallas_kernels.qk_scale_softmax.forward_kernel_for` picks, the logits never in
memory), else plain jnp (:mod:`jax_ops.ops.qk_scale_softmax.reference`; the ``"xla"``
backend). Residuals: Q, K and P.

Every backend's backward computes the reference's ``renormalize=True`` form: a row of the
bf16 P within ``2**-6`` of summing to 1 is corrected to sum to 1 and ``dL`` is rounded
once, which keeps the gradient of a sharp softmax (``P_ii`` rounding to 1) that the spec's
``dL`` loses (``docs/qk_scale_softmax.md``).
"""

from __future__ import annotations

import functools
import math

import jax

from jax_ops import _common
from jax_ops.backend import INPUTS
from jax_ops.ops.qk_scale_softmax import reference
from pallas_kernels import validation

OP = "qk_scale_softmax"


def qk_scale_softmax(query: jax.typing.ArrayLike, key: jax.typing.ArrayLike, *,
                     scaling: float | None = None, causal: bool = False,
                     implementation: str | None = None, interpret: bool = False) -> jax.Array:
  """Attention weights ``softmax((Q @ K^T) * scaling)``.

  Args:
    query: ``[B, H, Sq, D]`` (bf16 in the usual case; fp16 and fp32 work too).
    key: ``[B, H, Sk, D]``, same dtype.
    scaling: the logits' scale, a finite Python float > 0; ``None`` means ``1/sqrt(D)``.
    causal: mask keys ``k > q + (Sk - Sq)`` (needs ``Sq <= Sk``); the Pallas
      backward then skips the tiles above the diagonal.
    implementation: ``None`` (the fastest backend for the device), ``"pallas"``,
      ``"triton"``, ``"mosaic_gpu"``, ``"xla"`` or a registered name: the backward pass,
      and the forward (the Pallas backends run the fused forward kernel, ``"xla"`` jnp).
    interpret: run Pallas kernels in the interpreter (for CPU).

  Returns:
    ``[B, H, Sq, Sk]`` in the dtype of ``query`` (fp32 logits and softmax).
  """
  query, key = validation.as_jax(query, key)
  validation.check_query_and_key(query, key, dtypes=_common.FLOATS)
  _, _, sq, d = query.shape
  causal = validation.check_causal(causal, sq, key.shape[2])
  if scaling is None:
    scaling = 1.0 / math.sqrt(d)
  scaling = validation.check_scaling("scaling", scaling)
  if scaling is None:
    raise TypeError("scaling: expected a Python float (or None for 1/sqrt(D)), got a traced value")
  backend, _ = _common.backend_for(OP, implementation, interpret, (INPUTS,), causal,
                                   query=query, key=key)
  return _op(query, key, scaling, causal, backend, bool(interpret))


def _forward(query, key, scaling, causal, backend, interpret):
  """P from the backend's forward kernel where it has one, else from the jnp forward."""
  forward = getattr(backend, "forward", None)
  if forward is None:
    return reference.qk_scale_softmax_forward(query, key, scaling, causal)
  return forward(query, key, scaling, causal=causal, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _op(query, key, scaling, causal, backend, interpret):
  return _forward(query, key, scaling, causal, backend, interpret)


def _fwd(query, key, scaling, causal, backend, interpret):
  query, key = _common.first_order_only(backend, (query, key))
  probs = _forward(query, key, scaling, causal, backend, interpret)
  return probs, (query, key, probs)


def _bwd(scaling, causal, backend, interpret, res, grad_probs):
  res, grad_probs = _common.first_order_only(backend, (res, grad_probs))
  query, key, probs = res
  grads = backend.backward(grad_probs, query, key, probs, scaling, causal=causal,
                           interpret=interpret)
  return _common.checked_grads(backend, tuple(grads), (query, key), ("query", "key"))


_op.defvjp(_fwd, _bwd)
