"""The plain-jnp references of the three ops, in one place: each op's backward (the spec,
also its ``"xla"`` backend) and forward. They live beside their ops
(``jax_ops/ops/<op>/reference.py``); this module gathers them."""

from jax_ops._common import causal_mask, dropout_keep_mask, effective_dropout_rate
from jax_ops.ops.attention_softmax_dropout_value.reference import (
    attention_softmax_dropout_value_backward_reference,
    attention_softmax_dropout_value_forward,
)
from jax_ops.ops.masked_softmax_dropout.reference import (
    masked_softmax_dropout_backward_reference,
    masked_softmax_dropout_forward,
)
from jax_ops.ops.qk_scale_softmax.reference import (
    qk_scale_softmax_backward_reference,
    qk_scale_softmax_forward,
)

__all__ = [
    "attention_softmax_dropout_value_backward_reference",
    "attention_softmax_dropout_value_forward",
    "causal_mask",
    "dropout_keep_mask",
    "effective_dropout_rate",
    "masked_softmax_dropout_backward_reference",
    "masked_softmax_dropout_forward",
    "qk_scale_softmax_backward_reference",
    "qk_scale_softmax_forward",
]
