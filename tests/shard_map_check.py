"""Run by tests/test_transforms.py in a subprocess with 4 forced CPU devices, and on
a machine with several GPUs as it is (``PYTHONPATH=. python3 tests/shard_map_check.py``).

A training step of a tiny model that uses all three ops (Pallas kernels in
interpret mode on CPU, compiled on GPU), jitted over a mesh of all devices with
batch-sharded inputs through
``jax.shard_map``; prints JSON: the largest relative difference (norm) from the
single-device loss and gradients, and the all-gather ops in the compiled program.
"""

import json
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ops  # noqa: E402

B, H, KVH, S, D = 8, 4, 2, 16, 16
OPS = dict(implementation="pallas", interpret=jax.default_backend() != "gpu")


def loss(params, x, mask):
  q = jnp.einsum("bhsd,de->bhse", x, params["wq"])
  k = jnp.einsum("bhsd,de->bhse", x, params["wk"])
  v = jnp.einsum("bhsd,de->bhse", x[:, :KVH], params["wv"])
  scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / 4.0
  a = jax_ops.attention_softmax_dropout_value(scores.astype(jnp.bfloat16), v.astype(jnp.bfloat16), **OPS)
  b = jax_ops.masked_softmax_dropout(scores, mask, **OPS)
  c = jax_ops.qk_scale_softmax(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), causal=True, **OPS)
  return (jnp.sum(a.astype(jnp.float32) ** 2) + jnp.sum(b ** 2)
          + jnp.sum(c.astype(jnp.float32) ** 2)) / B


def main():
  keys = jax.random.split(jax.random.key(0), 5)
  params = {n: jax.random.normal(k, (D, D)) / 4 for n, k in zip(("wq", "wk", "wv"), keys)}
  x = jax.random.normal(keys[3], (B, H, S, D))
  mask = jax.random.bernoulli(keys[4], 0.8, (B, 1, S, S))
  single = jax.jit(jax.value_and_grad(loss))(params, x, mask)

  mesh = jax.make_mesh((jax.device_count(),), ("batch",))

  # The Pallas interpreter pads with unvarying constants, which check_vma rejects
  # (an upstream limitation); compiled kernels declare their outputs' varying axes.
  check_vma = not OPS["interpret"]

  def per_shard(params, x, mask):
    value, grads = jax.value_and_grad(loss)(params, x, mask)
    # With check_vma=True the gradients of the replicated params come back already summed
    # over the axis (the transpose of the implicit broadcast is a psum); without it, sum them.
    return jax.lax.psum(value, "batch"), grads if check_vma else jax.lax.psum(grads, "batch")

  step = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("batch"), P("batch")),
                               out_specs=P(), check_vma=check_vma))
  put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))
  params, x, mask = put(params, P()), put(x, P("batch")), put(mask, P("batch"))
  sharded = step(params, x, mask)
  diff = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) for a, b in
             zip(jax.tree.leaves(single), jax.tree.leaves(sharded)))
  hlo = step.lower(params, x, mask).compile().as_text()
  gathers = re.findall(r"all-gather[^\n]*", hlo)
  print(json.dumps({"devices": jax.device_count(), "check_vma": check_vma, "max_rel_diff": diff,
                    "loss": float(single[0]), "all_gathers": gathers,
                    "all_reduces": len(re.findall(r"all-reduce", hlo))}))


if __name__ == "__main__":
  main()
