"""The three differentiable ops (each defined in its folder's ``api.py``)."""

from jax_ops.attention_value.api import attention_softmax_dropout_value
from jax_ops.masked_softmax.api import masked_softmax_dropout
from jax_ops.qk_softmax.api import qk_scale_softmax

__all__ = ["attention_softmax_dropout_value", "masked_softmax_dropout", "qk_scale_softmax"]
