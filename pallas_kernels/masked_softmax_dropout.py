"""Masked softmax -> dropout backward (problem B), a Pallas Triton kernel.

Forward (for context): ``P = softmax(scores.masked_fill(~mask, -1e4))``,
``y = P * keep / (1 - p)``. Backward, all fp32 inside::

    gd = g * keep / (1 - p)        (gd = g when p == 0; keep is then not read)
    s  = rowsum(P * gd)            (over all columns: the mask is not applied)
    dS = where(mask, P * (gd - s), 0)

Design: the op is a row-wise reduction followed by an elementwise update, so
one program owns ``block_rows`` whole rows of one head and reads g, P, keep
and the mask exactly once (all four loads issued together, so a program waits
for one memory round trip); the result is written once. Triton blocks are
powers of two, so a row of odd length is either padded to the next power of
two or covered by two masked power-of-two column chunks (131 = 128 + 4 lanes
rather than 256); the tuned table picks per row-length class. That is the
minimum traffic: 4 + 4 (+1 keep) bytes in, 4 out per element, plus the
[B, 1, Sq, Sk] attention mask. The launch grid is (heads, batch * row blocks)
with heads fastest, so the H programs that share a mask tile run together and
the mask comes from L2 after its first read. ``block_rows`` and the warps per
program come from ``tuned/masked_softmax_dropout.json`` (measured on an H200 by
``benchmarks/tune.py``), else a heuristic of a few thousand elements per program.

On the H200: 81.4% of the memory floor in geomean over the 16 workloads (XLA
52%), 87-96% on large aligned ones; rows of odd length (loads cannot be
vectorised) reach 74-83%, and the smallest problems (1.6-4 us floors) are
latency-bound at 51-74% (``benchmarks/results/masked_softmax_dropout.md``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import validation as _checks, _tuning
from pallas_kernels._util import (compiler_params, dropout_scale, next_power_of_2,
                                  out_struct, pallas_call)


@dataclasses.dataclass(frozen=True)
class Config:
  """Launch configuration.

  Attributes:
    block_rows: rows per program (a power of two).
    num_warps: Triton warps per program.
    split: cover a row whose length is not a power of two with two power-of-two
      column chunks (the largest power of two <= Sk, then the rest padded),
      instead of one chunk padded to ``next_power_of_2(Sk)`` (up to 2x idle lanes).
  """
  block_rows: int
  num_warps: int
  split: bool = True


_KERNEL = "masked_softmax_dropout"


def column_chunks(sk: int, split: bool) -> tuple[tuple[int, int], ...]:
  """``(start, width)`` power-of-two column chunks that cover a row of ``sk``."""
  if not split or sk & (sk - 1) == 0:
    return ((0, next_power_of_2(sk)),)
  main = 1 << (sk.bit_length() - 1)
  return ((0, main), (main, next_power_of_2(sk - main)))


def config_for(sq: int, sk: int, *, target: int, num_warps: int, split: bool) -> Config:
  """About ``target`` elements per program: many short rows or one long one."""
  width = sum(w for _, w in column_chunks(sk, split))
  cap = max(1, min(target // width, next_power_of_2(sq)))
  return Config(1 << (cap.bit_length() - 1), num_warps, split)


def length_class(sk: int) -> str:
  """The tuning table's key for rows of ``sk``: the padded length, and whether it is padded.

  Rows whose length is not a power of two are split or padded and their loads cannot be
  vectorised (odd strides), so they are tuned apart from the aligned ones.
  """
  width = next_power_of_2(sk)
  return str(width) if width == sk else f"{width}-ragged"


def default_config(sq: int, sk: int, device_kind: str | None = None) -> Config:
  """The tuned config for this row length on this device, else a heuristic."""
  table = _tuning.table(_KERNEL, device_kind or "")
  tuned = table.get(length_class(sk)) or table.get(str(next_power_of_2(sk)))
  if tuned:
    return config_for(sq, sk, target=tuned["target"], num_warps=tuned["num_warps"],
                      split=tuned["split"])
  target = 4096
  return config_for(sq, sk, target=target, num_warps=4 if next_power_of_2(sk) <= 512 else 8,
                    split=True)


def _kernel(*refs, num_heads, n_rows, n_cols, block_rows, chunks, dropout):
  if dropout == "dynamic":
    scale_ref, g_ref, p_ref, mask_ref, keep_ref, o_ref = refs
  elif dropout == "none":
    g_ref, p_ref, mask_ref, o_ref = refs
  else:
    g_ref, p_ref, mask_ref, keep_ref, o_ref = refs
  h = pl.program_id(0)
  n_row_blocks = pl.cdiv(n_rows, block_rows)
  t = pl.program_id(1)
  b = t // n_row_blocks
  r0 = (t % n_row_blocks) * block_rows
  rows = r0 + jnp.arange(block_rows)
  bh = b * num_heads + h

  # Pass over the chunks once to load everything and reduce the row sum, then
  # once more (from registers) to write: every byte is read exactly once.
  loaded = []
  s = jnp.zeros((block_rows, 1), jnp.float32)
  for c0, width in chunks:
    # A traced start: a constant one past the row's end fails the indexer's
    # static bounds check even though the masked access is fine.
    c0 = h * 0 + c0
    cols = c0 + jnp.arange(width)
    valid = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tile = (bh, pl.ds(r0, block_rows), pl.ds(c0, width))
    g = pltriton.load(g_ref.at[tile], mask=valid, other=0.0,
                      eviction_policy="evict_first").astype(jnp.float32)
    probs = pltriton.load(p_ref.at[tile], mask=valid, other=0.0,
                          eviction_policy="evict_first").astype(jnp.float32)
    if dropout == "none":
      gd = g
    elif dropout == "dynamic":
      # A traced rate: when it is 0 the predicated-off load never touches memory.
      keep = pltriton.load(keep_ref.at[tile], mask=valid & (scale_ref[1] > 0), other=True,
                           eviction_policy="evict_first")
      gd = jnp.where(keep, g * scale_ref[0], 0.0)
    else:
      keep = pltriton.load(keep_ref.at[tile], mask=valid, other=False,
                           eviction_policy="evict_first")
      gd = jnp.where(keep, g * dropout, 0.0)
    # The attention mask is loaded with the others (not after the row sum), so a
    # program waits for one round trip to memory, not two.
    attend = pltriton.load(mask_ref.at[b, pl.ds(r0, block_rows), pl.ds(c0, width)],
                           mask=valid, other=False)
    s = s + jnp.sum(probs * gd, axis=1, keepdims=True)
    loaded.append((c0, width, valid, probs, gd, attend))
  for c0, width, valid, probs, gd, attend in loaded:
    out = jnp.where(attend, probs * (gd - s), 0.0)
    pltriton.store(o_ref.at[bh, pl.ds(r0, block_rows), pl.ds(c0, width)],
                   out.astype(o_ref.dtype), mask=valid)


@functools.partial(jax.jit, static_argnames=("p_static", "config", "num_stages", "interpret"))
def _call(grad_output, p_attn, mask, dropout_mask, p_dropout, *, p_static, config, num_stages,
          interpret):
  b, h, sq, sk = p_attn.shape
  block_rows = config.block_rows
  if p_static is None:
    dropout = "dynamic"
  elif p_static == 0.0:
    dropout = "none"
  else:
    dropout = dropout_scale(p_static)
  kernel = functools.partial(_kernel, num_heads=h, n_rows=sq, n_cols=sk, block_rows=block_rows,
                             chunks=column_chunks(sk, config.split), dropout=dropout)
  args = [grad_output.reshape(b * h, sq, sk), p_attn.reshape(b * h, sq, sk),
          mask.reshape(b, sq, sk)]
  if dropout == "dynamic":
    p = jnp.asarray(p_dropout, jnp.float32)
    # An invalid traced rate (outside [0, 1), NaN) gives NaN gradients, not wrong ones.
    inv = _checks.nan_unless_rate_valid(p, 1.0 / (1.0 - p))
    args.insert(0, jnp.stack([inv, (p > 0).astype(jnp.float32)]))
  if dropout != "none":
    args.append(dropout_mask.reshape(b * h, sq, sk))
  out = pallas_call(
      kernel,
      out_shape=out_struct((b * h, sq, sk), p_attn.dtype, *args),
      grid=(h, b * pl.cdiv(sq, block_rows)),
      compiler_params=compiler_params(config.num_warps, num_stages),
      interpret=interpret,
      name="masked_softmax_dropout_backward",
  )(*args)
  return out.reshape(b, h, sq, sk)


def masked_softmax_dropout_backward(grad_output, p_attn, mask, dropout_mask, p_dropout, *,
                                    config: Config | None = None, num_stages: int = 1,
                                    interpret: bool = False):
  """Gradient of the scores through masked softmax and dropout.

  Args:
    grad_output: ``[B, H, Sq, Sk]`` float (fp32 in the usual case), gradient of
      the dropout output.
    p_attn: ``[B, H, Sq, Sk]``, same dtype, the softmax output P.
    mask: ``[B, 1, Sq, Sk]`` bool, True = attend; broadcast over the heads.
    dropout_mask: ``[B, H, Sq, Sk]`` bool, True = kept. Never read when the rate
      is 0 (it may then be ``None`` if the rate is a Python number).
    p_dropout: dropout rate in [0, 1): a Python float, or a traced scalar (one outside
      [0, 1) gives NaN gradients, since nothing can raise at run time).
    config: launch configuration; default: tuned for the device, else a heuristic.
    num_stages: Triton pipelining depth (the kernel has no loop; 1 is right).
    interpret: run the kernel in the Pallas interpreter (any backend).

  Returns:
    ``grad_scores [B, H, Sq, Sk]`` in the dtype of ``p_attn``.
  """
  p = _checks.check_problem_b(grad_output, p_attn, mask, dropout_mask, p_dropout)
  if config is None:
    device_kind = None if interpret else jax.devices()[0].device_kind
    config = default_config(p_attn.shape[2], p_attn.shape[3], device_kind)
  if config.block_rows < 1 or config.block_rows & (config.block_rows - 1):
    raise ValueError(f"config.block_rows: expected a power of two, got {config.block_rows}")
  if config.num_warps < 1 or num_stages < 1:
    raise ValueError(f"config.num_warps and num_stages must be >= 1, got {config.num_warps} "
                     f"and {num_stages}")
  return _call(grad_output, p_attn, mask, dropout_mask, p_dropout, p_static=p, config=config,
               num_stages=num_stages, interpret=interpret)
