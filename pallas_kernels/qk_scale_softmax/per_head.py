"""The ``"per_head"`` scheme of the qk_scale_softmax backward: one Pallas Triton program per
head, for rows of at most ``MAX_PER_HEAD_ROW`` keys.

A program walks its head's query tiles of whole rows: ``delta``, ``dL`` and ``grad_query``
come from one read of ``g`` and ``P`` (4 B per attention element in bf16, the floor), and
``grad_key`` (``[Sk, D]`` fp32) stays in registers until the head's last tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _triton_tiles as tiles
from pallas_kernels._util import compiler_params, dot, next_power_of_2, out_struct, pallas_call
from pallas_kernels.qk_scale_softmax import _common as cm
from pallas_kernels.qk_scale_softmax._common import F32, I32, ZERO
from pallas_kernels.qk_scale_softmax.config import MAX_PER_HEAD_ROW


def _head_kernel(scale_ref, g_ref, p_ref, q_ref, k_ref, dq_ref, dk_ref, *, seq_q: int,
                 seq_k: int, head_dim: int, block_q: int, causal: bool, renormalize: bool):
  """One program: a whole head (``"per_head"`` scheme, short rows).

  Walks the head's query tiles; each holds whole rows (``Sk`` padded), so ``delta``, ``dL``
  and ``grad_query`` are done in one read of ``g`` and ``P``. ``grad_key`` accumulates in
  registers over the tiles (``[Sk, D]`` fp32: only for short rows) and is stored once.
  Causal: the loads are masked above the diagonal.
  """
  bh = pl.program_id(0)
  dtype = g_ref.dtype
  d_pad = tiles.padded_head_dim(head_dim)
  block_k = next_power_of_2(max(seq_k, 16))
  scale = scale_ref[0]
  cols = jnp.arange(block_k, dtype=I32)
  col_ok = cols < seq_k
  d_ok = jnp.arange(d_pad, dtype=I32) < head_dim
  offset = seq_k - seq_q
  k = pltriton.load(k_ref.at[bh, tiles.ds(ZERO, block_k), tiles.ds(ZERO, d_pad)],
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)

  def body(i, acc):
    q_start = i * block_q
    rows = q_start + jnp.arange(block_q, dtype=I32)
    row_ok = rows < seq_q
    mask = row_ok[:, None] & col_ok[None, :]
    if causal:
      mask &= cols[None, :] <= rows[:, None] + offset
    idx = (bh, pl.ds(q_start, block_q), tiles.ds(ZERO, block_k))
    g = pltriton.load(g_ref.at[idx], mask=mask, other=0.0)
    p = pltriton.load(p_ref.at[idx], mask=mask, other=0.0)
    d_l = cm.dl_tile(g, p, cm.whole_row_stats(g, p, renormalize), scale, dtype)
    qd_idx = (bh, pl.ds(q_start, block_q), tiles.ds(ZERO, d_pad))
    qd_mask = row_ok[:, None] & d_ok[None, :]
    pltriton.store(dq_ref.at[qd_idx], dot(d_l, k).astype(dq_ref.dtype), mask=qd_mask)
    q = pltriton.load(q_ref.at[qd_idx], mask=qd_mask, other=0.0)
    return acc + dot(d_l, q, trans_a=True)

  acc = tiles.fori_loop(0, pl.cdiv(seq_q, block_q), body, jnp.zeros((block_k, d_pad), F32))
  pltriton.store(dk_ref.at[bh, tiles.ds(ZERO, block_k), tiles.ds(ZERO, d_pad)],
                 acc.astype(dk_ref.dtype), mask=col_ok[:, None] & d_ok[None, :])


@functools.partial(jax.jit, static_argnames=("causal", "cfg", "interpret", "renormalize"))
def head_pass(scale, g, p, q, k, *, causal, cfg, interpret, renormalize=False):
  """``(grad_query, grad_key)`` of 3D ``[B*H, ...]`` views, one program per head
  (``renormalize``: the form of ``dL``, ``_common``)."""
  bh, seq_q, seq_k = g.shape
  head_dim = q.shape[-1]
  if next_power_of_2(seq_k) > MAX_PER_HEAD_ROW:
    raise ValueError(f"the per_head scheme takes rows of at most {MAX_PER_HEAD_ROW} keys, "
                     f"got Sk={seq_k}")
  return pallas_call(
      functools.partial(_head_kernel, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim,
                        block_q=cfg.block_q, causal=causal, renormalize=renormalize),
      out_shape=(out_struct((bh, seq_q, head_dim), q.dtype, g, p, q, k),
                 out_struct((bh, seq_k, head_dim), q.dtype, g, p, q, k)),
      grid=(bh,),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="qk_scale_softmax_bwd_head",
  )(scale, g, p, q, k)
