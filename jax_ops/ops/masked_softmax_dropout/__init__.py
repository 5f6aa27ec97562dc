"""masked_softmax_dropout: ``dropout(softmax(scores.masked_fill(~mask, -1e4)))`` (fp32).

``api.py`` is the differentiable op, ``reference.py`` its plain-jnp forward and backward
(the spec), ``xla.py`` and ``pallas_triton.py`` the backends of its backward.
"""
