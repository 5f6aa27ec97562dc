"""Trains a small transformer with optax under jax.jit, once with the Pallas
backward passes and once with the XLA references (same seed), and prints both
loss curves and both step times (off a GPU the Pallas kernels run in the
interpreter, so only the loss curves compare).

Task: each position predicts the token two places back (a causal copy task the
attention layers must learn). Each block has one of each attention layer of
``jax_ops.nnx``.

    .venv/bin/python examples/train_transformer.py [--steps 300] [--seq 32] [--batch 16]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jax_ops.nnx import GQASelfAttention, MaskedAttention, QKSoftmaxAttention
from jax_ops.reference import causal_mask

VOCAB, E, S, B = 32, 64, 32, 16


class Block(nnx.Module):
  def __init__(self, *, impl, interpret, rngs):
    kw = dict(implementation=impl, interpret=interpret, rngs=rngs)
    self.gqa = GQASelfAttention(E, 4, 2, 16, dropout_rate=0.1, dtype=jnp.float32, **kw)
    self.masked = MaskedAttention(E, 4, 16, dropout_rate=0.1, **kw)
    self.qk = QKSoftmaxAttention(E, 4, 16, causal=True, dtype=jnp.float32, **kw)
    self.norm = nnx.LayerNorm(E, rngs=rngs)
    self.mlp = nnx.Linear(E, E, rngs=rngs)

  def __call__(self, x, deterministic):
    mask = causal_mask(S, S)[None, None]
    h = self.norm(x)
    x = x + self.gqa(h, mask, deterministic=deterministic)
    x = x + self.masked(h, jnp.broadcast_to(mask, (h.shape[0], 1, S, S)),
                        deterministic=deterministic)
    x = x + self.qk(h)
    return x + nnx.gelu(self.mlp(self.norm(x)))


class Model(nnx.Module):
  def __init__(self, *, impl, interpret, seed):
    rngs = nnx.Rngs(params=seed, dropout=seed + 1)
    self.embed = nnx.Embed(VOCAB, E, rngs=rngs)
    self.blocks = nnx.List([Block(impl=impl, interpret=interpret, rngs=rngs) for _ in range(2)])
    self.head = nnx.Linear(E, VOCAB, rngs=rngs)

  def __call__(self, tokens, deterministic=False):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, deterministic)
    return self.head(x)


def batch(step):
  tokens = jax.random.randint(jax.random.key(step), (B, S), 0, VOCAB)
  return tokens, jnp.roll(tokens, 2, axis=1)


def train(impl, steps, interpret):
  model = Model(impl=impl, interpret=interpret, seed=0)
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, tokens, targets):
    def loss_fn(model):
      logits = model(tokens)[:, 2:]
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets[:, 2:]).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses, times = [], []
  for i in range(steps):
    tokens, targets = batch(i)
    start = time.perf_counter()
    loss = float(step(model, optimizer, tokens, targets))  # float() waits for the step
    times.append(time.perf_counter() - start)
    losses.append(loss)
  return losses, sorted(times[1:])[len(times[1:]) // 2]


def main():
  global S, B
  parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seq", type=int, default=S, help="sequence length")
  parser.add_argument("--batch", type=int, default=B, help="batch size")
  args = parser.parse_args()
  S, B = args.seq, args.batch
  on_gpu = jax.default_backend() == "gpu"
  print(f"backend {jax.default_backend()}: Pallas kernels {'compiled' if on_gpu else 'interpreted'}"
        f"; batch {B}, sequence {S}, {args.steps} steps")
  results = {impl: train(impl, args.steps, interpret=not on_gpu) for impl in ("pallas", "xla")}
  for i in sorted({0, args.steps // 4, args.steps // 2, args.steps - 1}):
    print(f"step {i:4d}  loss pallas {results['pallas'][0][i]:.4f}  xla {results['xla'][0][i]:.4f}")
  # Off a GPU only the Pallas path runs in the interpreter; XLA's path is compiled for the CPU.
  where = {"pallas": "Pallas interpreter on the CPU, not a speed measurement",
           "xla": "XLA compiled for the CPU"}
  for impl, (_, median) in results.items():
    print(f"{impl:>6}: median step time {median * 1e3:.2f} ms (wall clock"
          f"{'' if on_gpu else ', ' + where[impl]})")


if __name__ == "__main__":
  main()
