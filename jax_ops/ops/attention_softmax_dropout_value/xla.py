"""The ``"xla"`` backend of the op's backward: the plain-jnp reference."""

from jax_ops.backend import ReferenceBackend
from jax_ops.ops.attention_softmax_dropout_value.reference import attention_softmax_dropout_value_backward_reference

BACKEND = ReferenceBackend(attention_softmax_dropout_value_backward_reference)
