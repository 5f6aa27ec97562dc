"""The three differentiable ops, one package each: ``api.py`` (the op), ``reference.py``
(plain jnp), ``xla.py`` and one file per Pallas backend."""
