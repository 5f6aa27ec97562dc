"""The forward of masked softmax -> dropout in one Pallas Triton row kernel.

``y = softmax(scores.masked_fill(~mask, -1e4)) * keep / (1 - p)``, with ``keep`` drawn in the
kernel by the counter-based hash of ``pallas_kernels._dropout`` (``jax_ops.dropout_keep_mask``
bit for bit; ``p`` the rate it draws, a multiple of ``2**-16``). One program owns
``block_rows`` whole rows (padded to a power of two) of one head: it reads the scores and the
attention mask once and writes ``y`` once (4 B in, 4 B out per fp32 element; the mask is
shared by the heads, and a mask that broadcasts to ``[B, 1, Sq, Sk]`` is read through its own
shape: :func:`mask_operand`, :func:`load_mask`). One 32-bit hash draws two elements of
``keep``. Neither P nor ``keep`` is written: the backward
(``masked_softmax_dropout_backward_from_scores``) recomputes P from the scores and redraws
the mask from the key.
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
_F32 = jnp.float32
_U32 = jnp.uint32


def masked_fill(s, attend, valid):
  """``s.masked_fill(~attend, -1e4)`` in fp32, ``-inf`` outside the array (``valid``
  false): the softmax's input, here and in the backward that recomputes P."""
  return jnp.where(valid, jnp.where(attend, s.astype(_F32), -1e4), -jnp.inf)


def mask_operand(mask, batch: int, seq_q: int, seq_k: int):
  """``(mask3, broadcast)``: a mask that broadcasts to ``[B, 1, Sq, Sk]`` as the kernels
  read it, ``[B', Sq', Sk']`` (a reshape: the head axis and missing leading axes dropped,
  nothing copied), and per axis whether it is broadcast (size 1 where the scores have
  more), for :func:`load_mask`."""
  shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
  broadcast = (shape[0] != batch, shape[2] != seq_q, shape[3] != seq_k)
  return mask.reshape(shape[0], shape[2], shape[3]), broadcast


def load_mask(mask_ref, broadcast, b, r0, rows_n, c0, width, valid, seq_q, seq_k, **load):
  """The mask's ``[rows_n, width]`` tile of batch entry ``b`` at rows ``r0``, columns
  ``c0`` (False outside the array: ``valid``). A broadcast axis (:func:`mask_operand`) is
  read at index 0, one row or one column, and broadcast in registers."""
  bcast_b, bcast_q, bcast_k = broadcast
  b = b * 0 if bcast_b else b      # traced: the indexer takes no Python int here
  if not (bcast_q or bcast_k):
    return pltriton.load(mask_ref.at[b, pl.ds(r0, rows_n), pl.ds(c0, width)], mask=valid,
                         other=False, **load)
  rows = pl.ds(0, 1) if bcast_q else pl.ds(r0, rows_n)
  cols = pl.ds(0, 1) if bcast_k else pl.ds(c0, width)
  inside = None
  if not bcast_q:
    inside = (r0 + jnp.arange(rows_n))[:, None] < seq_q
  if not bcast_k:
    col_ok = (c0 + jnp.arange(width))[None, :] < seq_k
    inside = col_ok if inside is None else inside & col_ok
  if inside is None:   # one element, broadcast both ways: always inside the array
    tile = pltriton.load(mask_ref.at[b, rows, cols], **load)
  else:
    tile = pltriton.load(mask_ref.at[b, rows, cols], mask=inside, other=False, **load)
  return jnp.broadcast_to(tile, (rows_n, width))


def masked_softmax(s, attend, valid, dtype):
  """``softmax(s.masked_fill(~attend, -1e4))`` over the rows of a tile (fp32 inside, rounded
  to ``dtype``); ``valid`` marks the tile's elements inside the array (the others are 0)."""
  filled = masked_fill(s, attend, valid)
  e = jnp.exp(filled - jnp.max(filled, axis=1, keepdims=True))
  return (e / jnp.sum(e, axis=1, keepdims=True)).astype(dtype)


def _kernel(seeds_ref, scale_ref, s_ref, mask_ref, y_ref, *, num_heads, seq_q, seq_k,
            block_rows, width, dropout, mask_broadcast):
  bh = pl.program_id(0)
  r0 = pl.program_id(1) * block_rows
  b = bh // num_heads
  rows = r0 + jnp.arange(block_rows)
  cols = jnp.arange(width)
  valid = (rows[:, None] < seq_q) & (cols[None, :] < seq_k)
  c0 = bh * 0                      # a traced column start (the indexer's static bounds)
  tile = (bh, pl.ds(r0, block_rows), pl.ds(c0, width))
  s = pltriton.load(s_ref.at[tile], mask=valid, other=0.0)
  attend = load_mask(mask_ref, mask_broadcast, b, r0, block_rows, c0, width, valid, seq_q,
                     seq_k)
  probs = masked_softmax(s, attend, valid, y_ref.dtype)
  if not dropout:
    pltriton.store(y_ref.at[tile], probs, mask=valid)
    return
  u = _dropout.tile_bits16(seeds_ref[0], seeds_ref[1], bh.astype(_U32),
                           rows.astype(_U32)[:, None], np.uint32(0), width, seq_k, pairs=True)
  keep = u >= seeds_ref[2]
  # As the reference: (P * keep) * scale, so an invalid traced rate (a NaN scale) gives NaN.
  y = (probs.astype(_F32) * keep.astype(_F32) * scale_ref[0]).astype(y_ref.dtype)
  pltriton.store(y_ref.at[tile], y, mask=valid)


def default_launch(seq_k: int) -> tuple[int, int]:
  """``(block_rows, num_warps)``: whole rows, about 1024 elements per program (at most 16
  rows), 4 warps, 8 on rows longer than 2048."""
  width = next_power_of_2(seq_k)
  return max(1, min(16, 1024 // width)), (4 if width <= 2048 else 8)


@functools.partial(jax.jit, static_argnames=("dropout", "block_rows", "num_warps",
                                             "interpret"))
def _call(scores, mask, seeds, scale, *, dropout, block_rows, num_warps, interpret):
  b, h, seq_q, seq_k = scores.shape
  mask, mask_broadcast = mask_operand(mask, b, seq_q, seq_k)
  kernel = functools.partial(_kernel, num_heads=h, seq_q=seq_q, seq_k=seq_k,
                             block_rows=block_rows, width=next_power_of_2(seq_k),
                             dropout=dropout, mask_broadcast=mask_broadcast)
  flat = (b * h, seq_q, seq_k)
  args = (seeds, scale, scores.reshape(flat), mask)
  y = pallas_call(
      kernel,
      out_shape=out_struct(flat, scores.dtype, *args),
      grid=(b * h, pl.cdiv(seq_q, block_rows)),
      compiler_params=compiler_params(num_warps, 1),
      interpret=interpret,
      name=_NAME,
  )(*args)
  return y.reshape(scores.shape)


def masked_softmax_dropout_forward(scores, mask, dropout_rate, dropout_rng=None, *,
                                   block_rows=None, num_warps=None, interpret=False):
  """``y = dropout(softmax(scores.masked_fill(~mask, -1e4)))``.

  Args:
    scores: ``[B, H, Sq, Sk]`` float (fp32 in the usual case; bf16, fp16).
    mask: bool, True = attend: ``[B, 1, Sq, Sk]`` or any shape that broadcasts to it
      (``pallas_kernels.validation.check_mask``: ``[B, 1, 1, Sk]``, ``[Sq, Sk]``, ...),
      read through its broadcast axes, never materialized.
    dropout_rate: in [0, 1), a Python float or a traced scalar; rounded to a multiple of
      ``2**-16`` (``pallas_kernels._dropout.effective_rate``), which scales the kept values.
    dropout_rng: a PRNG key (needed for a rate that may be > 0); the mask is
      ``jax_ops.dropout_keep_mask(dropout_rng, dropout_rate, scores.shape)``.
    block_rows, num_warps: launch overrides (default: :func:`default_launch`).
    interpret: run the kernel in the Pallas interpreter (any backend).

  Returns:
    ``y [B, H, Sq, Sk]`` in the scores' dtype.
  """
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
  rows, warps = default_launch(scores.shape[3])
  block_rows = rows if block_rows is None else int(block_rows)
  num_warps = warps if num_warps is None else int(num_warps)
  return _call(scores, mask, seeds, scale, dropout=dropout, block_rows=block_rows,
               num_warps=num_warps, interpret=bool(interpret))
