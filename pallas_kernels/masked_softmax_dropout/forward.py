"""The forward of masked softmax -> dropout in one Pallas Triton row kernel, drawing the
dropout mask itself.

``P = softmax(scores.masked_fill(~mask, -1e4))``, ``y = P * keep / (1 - p)`` with ``keep``
the counter-based mask of ``pallas_kernels._dropout`` (the one ``jax_ops.dropout_keep_mask``
draws, bit for bit, and ``p`` the rate it draws, rounded to a multiple of ``2**-16``). One
program owns ``block_rows`` whole rows (padded to a power of two) of one head: it reads the
scores and the attention mask once and writes ``y``, ``P`` and ``keep`` once (4 + 1 bytes in,
4 + 4 + 1 out per fp32 element; the mask is shared by the heads). One 32-bit hash draws two
elements of ``keep``. With ``store_keep=False`` it writes no ``keep`` (1 byte per element
less): a backward that redraws the mask from the key
(``masked_softmax_dropout_backward_from_key``) does not need it; with ``store_probs=False``
no ``P`` either, for the backward that recomputes it from the scores
(``masked_softmax_dropout_backward_from_scores``).

The forward of op B's Triton path (``jax_ops.masked_softmax_dropout``): residual policy
``"scores"`` (the default) with ``store_keep=False, store_probs=False``, ``"key"`` with
``store_keep=False``. Measured on an H200 storing keep (``benchmarks/b_forward.py``,
``benchmarks/results/runs/b_forward_b44b81d.log``): 1.34-1.74x faster than the jnp forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _dropout, _util, validation
from pallas_kernels._util import compiler_params, next_power_of_2, out_struct, pallas_call

_NAME = "masked_softmax_dropout_forward"
PAIR_HASH = True   # one hash per pair of columns: 1-3% faster (H200, y alone)
_F32 = jnp.float32
_U32 = jnp.uint32


def masked_fill(s, attend, valid):
  """``s.masked_fill(~attend, -1e4)`` in fp32, ``-inf`` outside the array (``valid``
  false): the softmax's input, here and in the backward that recomputes P."""
  return jnp.where(valid, jnp.where(attend, s.astype(_F32), -1e4), -jnp.inf)


def masked_softmax(s, attend, valid, dtype):
  """``softmax(s.masked_fill(~attend, -1e4))`` over the rows of a tile (fp32 inside, rounded
  to ``dtype``); ``valid`` marks the tile's elements inside the array (the others are 0)."""
  filled = masked_fill(s, attend, valid)
  e = jnp.exp(filled - jnp.max(filled, axis=1, keepdims=True))
  return (e / jnp.sum(e, axis=1, keepdims=True)).astype(dtype)


def _kernel(seeds_ref, scale_ref, s_ref, mask_ref, y_ref, *out_refs, num_heads, seq_q,
            seq_k, block_rows, width, dropout, store_probs, pair_hash):
  """``out_refs``: P's output (when ``store_probs``), then the keep mask's (when stored)."""
  bh = pl.program_id(0)
  r0 = pl.program_id(1) * block_rows
  b = bh // num_heads
  rows = r0 + jnp.arange(block_rows)
  cols = jnp.arange(width)
  valid = (rows[:, None] < seq_q) & (cols[None, :] < seq_k)
  c0 = bh * 0                      # a traced column start (the indexer's static bounds)
  tile = (bh, pl.ds(r0, block_rows), pl.ds(c0, width))
  s = pltriton.load(s_ref.at[tile], mask=valid, other=0.0)
  attend = pltriton.load(mask_ref.at[b, pl.ds(r0, block_rows), pl.ds(c0, width)],
                         mask=valid, other=False)
  probs = masked_softmax(s, attend, valid, y_ref.dtype)
  if store_probs:
    p_ref, *keep_ref = out_refs
    pltriton.store(p_ref.at[tile], probs, mask=valid)
  else:
    keep_ref = out_refs
  if not dropout:
    pltriton.store(y_ref.at[tile], probs, mask=valid)
    return
  u = _dropout.tile_bits16(seeds_ref[0], seeds_ref[1], bh.astype(_U32),
                           rows.astype(_U32)[:, None], np.uint32(0), width, seq_k,
                           pairs=pair_hash)
  keep = u >= seeds_ref[2]
  # As the reference: (P * keep) * scale, so an invalid traced rate (a NaN scale) gives NaN.
  y = (probs.astype(_F32) * keep.astype(_F32) * scale_ref[0]).astype(y_ref.dtype)
  if keep_ref:
    pltriton.store(keep_ref[0].at[tile], keep, mask=valid)
  pltriton.store(y_ref.at[tile], y, mask=valid)


def default_launch(seq_k: int) -> tuple[int, int]:
  """``(block_rows, num_warps)``: whole rows, about 1024 elements per program, 4 warps
  (8 on rows longer than 2048). Measured on the H200 writing y alone, against the earlier
  4096 elements on 8 warps and five other launches
  (``benchmarks/results/runs/b_forward_b44b81d.log``): 304 vs 322 us at B=8 H=16 S=1024,
  43 vs 46 us at (32, 8, 256), 1247 vs 1272 us at (16, 8, 2048); rows of 4096 keep 8 warps
  (643 us; 673 on 4)."""
  width = next_power_of_2(seq_k)
  return max(1, min(16, 1024 // width)), (4 if width <= 2048 else 8)


@functools.partial(jax.jit, static_argnames=("dropout", "store_probs", "store_keep",
                                             "pair_hash", "block_rows", "num_warps",
                                             "interpret"))
def _call(scores, mask, seeds, scale, *, dropout, store_probs, store_keep, pair_hash,
          block_rows, num_warps, interpret):
  b, h, seq_q, seq_k = scores.shape
  width = next_power_of_2(seq_k)
  kernel = functools.partial(_kernel, num_heads=h, seq_q=seq_q, seq_k=seq_k,
                             block_rows=block_rows, width=width, dropout=dropout,
                             store_probs=store_probs, pair_hash=pair_hash)
  flat = (b * h, seq_q, seq_k)
  args = (seeds, scale, scores.reshape(flat), mask.reshape(b, seq_q, seq_k))
  keep_out = dropout and store_keep   # no keep output without dropout either
  out_shape = (out_struct(flat, scores.dtype, *args),)
  if store_probs:
    out_shape += (out_struct(flat, scores.dtype, *args),)
  if keep_out:
    out_shape += (out_struct(flat, jnp.bool_, *args),)
  y, *rest = pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(b * h, pl.cdiv(seq_q, block_rows)),
      compiler_params=compiler_params(num_warps, 1),
      interpret=interpret,
      name=_NAME,
  )(*args)
  shape = scores.shape
  p = rest.pop(0).reshape(shape) if store_probs else None
  return y.reshape(shape), p, (rest[0].reshape(shape) if keep_out else None)


def masked_softmax_dropout_forward(scores, mask, dropout_rate, dropout_rng=None, *,
                                   store_keep: bool = True, store_probs: bool = True,
                                   pair_hash: bool = PAIR_HASH, block_rows=None,
                                   num_warps=None, interpret=False):
  """``(y, P, keep)`` of ``y = dropout(softmax(scores.masked_fill(~mask, -1e4)))``.

  Args:
    scores: ``[B, H, Sq, Sk]`` float (fp32 in the usual case; bf16, fp16).
    mask: ``[B, 1, Sq, Sk]`` bool, True = attend; broadcast over the heads.
    dropout_rate: in [0, 1), a Python float or a traced scalar; rounded to a multiple of
      ``2**-16`` (``pallas_kernels._dropout.effective_rate``), which scales the kept values.
    dropout_rng: a PRNG key (needed for a rate that may be > 0); the mask is
      ``jax_ops.dropout_keep_mask(dropout_rng, dropout_rate, scores.shape)``.
    store_keep: whether the kernel writes ``keep`` (a Python bool). ``False``: it is not
      written and ``None`` is returned for it (``y`` and ``P`` are the same).
    store_probs: whether the kernel writes ``P`` (a Python bool). ``False``: ``None`` is
      returned for it, for a backward that recomputes it from the scores
      (``masked_softmax_dropout_backward_from_scores``).
    pair_hash: whether the kernel hashes once per pair of columns (both 16-bit halves of each
      hash, interleaved by a join and a reshape) instead of once per element: the same mask.
      Default on: 1-3% faster on the H200 (``benchmarks/results/runs/b_forward_b44b81d.log``).
    block_rows, num_warps: launch overrides (default: :func:`default_launch`).
    interpret: run the kernel in the Pallas interpreter (any backend).

  Returns:
    ``y`` and ``P`` in the scores' dtype, ``keep`` ``[B, H, Sq, Sk]`` bool (``None`` for a
    concrete rate of 0, or with ``store_keep=False``; ``P`` is ``None`` with
    ``store_probs=False``).
  """
  for name, flag in (("store_keep", store_keep), ("store_probs", store_probs),
                     ("pair_hash", pair_hash)):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(f"{name}: expected a Python bool, got {type(flag).__name__}")
  for name, v, top in (("block_rows", block_rows, None), ("num_warps", num_warps, 32)):
    if v is not None and (isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))
                          or v < 1 or v & (v - 1) or (top and v > top)):
      want = f"a power of two in [1, {top}]" if top else "a power of two >= 1"
      raise ValueError(f"{name}: expected None or {want}, got {v!r}")
  _util.check_can_compile(_NAME, interpret, scores, mask)
  validation.check_scores_and_mask(scores, mask)
  # The reference's scale, 1 / (1 - p) in fp32, of the rate drawn; NaN for an invalid
  # traced rate.
  dropout, seeds, scale = _dropout.kernel_args(dropout_rate, dropout_rng)
  seq_k = scores.shape[3]
  rows, warps = default_launch(seq_k)
  block_rows = rows if block_rows is None else int(block_rows)
  num_warps = warps if num_warps is None else int(num_warps)
  return _call(scores, mask, seeds, scale, dropout=dropout, store_probs=bool(store_probs),
               store_keep=bool(store_keep), pair_hash=bool(pair_hash),
               block_rows=block_rows, num_warps=num_warps, interpret=bool(interpret))
