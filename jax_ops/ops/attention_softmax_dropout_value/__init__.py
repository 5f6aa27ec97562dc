"""Op A: softmax -> dropout -> grouped-query value matmul (bf16), with its backends.

``api.py`` is the differentiable op, ``reference.py`` its plain-jnp forward and backward
(the spec), ``xla.py`` and ``pallas_triton.py`` the backends of its backward.
"""
