"""softmax -> dropout -> grouped-query value matmul (bf16), with its backends.

``api.py`` is the differentiable op, ``reference.py`` its plain-jnp forward and backward
(the spec), ``xla.py``, ``pallas_triton.py`` and ``pallas_mosaic_gpu.py`` the backends of its
backward.
"""
