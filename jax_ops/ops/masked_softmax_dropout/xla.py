"""The ``"xla"`` backend of the masked_softmax_dropout backward: the plain-jnp reference."""

from jax_ops.backend import ReferenceBackend
from jax_ops.ops.masked_softmax_dropout.reference import masked_softmax_dropout_backward_reference

BACKEND = ReferenceBackend(masked_softmax_dropout_backward_reference)
