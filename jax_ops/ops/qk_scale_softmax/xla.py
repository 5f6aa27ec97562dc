"""The ``"xla"`` backend of the qk_scale_softmax backward: the plain-jnp reference in the op's
form (``renormalize=True``: P corrected to sum to 1, ``dL`` rounded once)."""

import functools

from jax_ops.backend import ReferenceBackend
from jax_ops.ops.qk_scale_softmax.reference import qk_scale_softmax_backward_reference

BACKEND = ReferenceBackend(functools.partial(qk_scale_softmax_backward_reference,
                                             renormalize=True))
