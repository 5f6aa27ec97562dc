"""Pallas GPU kernels for the backward passes of eager-mode attention.

Kernels only: arrays in, arrays out, no autodiff. The differentiable ops that
use them live in :mod:`jax_ops`.
"""

from pallas_kernels.attention_softmax_dropout_value import (
    attention_softmax_dropout_value_backward,
    attention_softmax_dropout_value_backward_from_delta,
)
from pallas_kernels.masked_softmax_dropout import masked_softmax_dropout_backward
from pallas_kernels.qk_scale_softmax import qk_scale_softmax_backward

__all__ = [
    "attention_softmax_dropout_value_backward",
    "attention_softmax_dropout_value_backward_from_delta",
    "masked_softmax_dropout_backward",
    "qk_scale_softmax_backward",
]
