"""Op C: ``softmax((Q @ K^T) * scaling)`` (bf16, optionally causal), with its backends.

``api.py`` is the differentiable op, ``reference.py`` its plain-jnp forward and backward
(the spec), ``xla.py`` and ``pallas_triton.py`` the backends of its backward.
"""
