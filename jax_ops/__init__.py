"""Differentiable attention ops with Pallas GPU backward passes.

Ops: :func:`attention_softmax_dropout_value`, :func:`masked_softmax_dropout`,
:func:`qk_scale_softmax`. Each takes ``implementation=`` (``None``, ``"pallas"``,
``"triton"``, ``"mosaic_gpu"``, ``"xla"`` or a name added with
:func:`jax_ops.registry.register`); see :mod:`jax_ops.registry`.
References (pure jnp): the ``*_backward_reference`` functions and the ``*_forward``
functions of :mod:`jax_ops.reference`.
"""

from jax_ops import registry
from jax_ops.ops.attention_softmax_dropout_value.api import attention_softmax_dropout_value
from jax_ops.ops.masked_softmax_dropout.api import masked_softmax_dropout
from jax_ops.ops.qk_scale_softmax.api import qk_scale_softmax
from jax_ops.reference import (
    attention_softmax_dropout_value_backward_reference,
    causal_mask,
    dropout_keep_mask,
    effective_dropout_rate,
    masked_softmax_dropout_backward_reference,
    qk_scale_softmax_backward_reference,
)

__all__ = [
    "attention_softmax_dropout_value",
    "attention_softmax_dropout_value_backward_reference",
    "causal_mask",
    "dropout_keep_mask",
    "effective_dropout_rate",
    "masked_softmax_dropout",
    "masked_softmax_dropout_backward_reference",
    "qk_scale_softmax",
    "qk_scale_softmax_backward_reference",
    "registry",
]
