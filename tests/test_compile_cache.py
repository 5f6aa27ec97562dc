"""A jitted op compiles once: its second call hits the cache (interpret mode too)."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# A fresh interpreter: in the test process other tests have already run the interpreter.
SCRIPT = r"""
import jax, jax.numpy as jnp
import jax_ops
k = jax.random.split(jax.random.key(0), 2)
s = jax.random.normal(k[0], (1, 2, 8, 8))
m = jnp.ones((1, 1, 8, 8), bool)
f = jax.jit(jax.grad(lambda s: jax_ops.masked_softmax_dropout(
    s, m, dropout_rate=0.1, dropout_rng=k[1], implementation="triton",
    interpret=True).sum()))
f(s).block_until_ready()
f(s).block_until_ready()
print("CACHE", f._cache_size())
"""


def test_second_call_hits_the_jit_cache():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  root = os.path.dirname(HERE)
  out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       env=env, cwd=root, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "CACHE 1" in out.stdout, out.stdout
