"""The ``"xla"`` backend of the qk_scale_softmax backward: the plain-jnp reference."""

from jax_ops.backend import ReferenceBackend
from jax_ops.ops.qk_scale_softmax.reference import qk_scale_softmax_backward_reference

BACKEND = ReferenceBackend(qk_scale_softmax_backward_reference)
