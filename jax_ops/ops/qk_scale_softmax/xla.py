"""The ``"xla"`` backend of the qk_scale_softmax backward: the plain-jnp reference in its
accurate form (``accurate=True``: ``P`` corrected to its softmax normalization, ``dL`` to fp32
precision as two GEMM operands; as accurate as autodiff of a mixed-precision jnp forward)."""

import functools

from jax_ops.backend import ReferenceBackend
from jax_ops.ops.qk_scale_softmax.reference import qk_scale_softmax_backward_reference

BACKEND = ReferenceBackend(functools.partial(qk_scale_softmax_backward_reference,
                                             accurate=True))
