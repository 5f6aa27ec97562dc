"""Pallas (Triton) kernel: backward of ``O = transpose(dropout(softmax) @ V)`` with GQA.

Problem A. The forward this differentiates is::

    P  = softmax(scores)                          # [B, H, Sq, Skv]  attn_weights
    Pd = dropout(P) = P * keep / (1 - p)          # [B, H, Sq, Skv]  attn_weights_dropped
    O  = transpose(Pd @ repeat(V, G, axis=1))     # [B, Sq, H, D]    (G = H // KVH)

and the backward, given ``dO = grad_attn_output``, is::

    dPd    = dO[b, :, h, :] @ V[b, h // G]^T                 (fp32 accumulation)
    dW     = dPd * keep / (1 - p)                           (p == 0: dW = dPd)
    delta  = rowsum(dW * P)                                  (over Skv)
    dS     = P * (dW - delta)                                -> grad_attn_scores
    dV[k]  = sum_{h in group k} Pd[h]^T @ dO[h]               -> grad_value_states

See :func:`attention_softmax_dropout_value_backward` for the design notes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import validation as _checks, _phase, _tuning
from pallas_kernels._util import (compiler_params, dot, dropout_scale, next_power_of_2,
                                  out_struct, pallas_call)

__all__ = ["attention_softmax_dropout_value_backward",
           "attention_softmax_dropout_value_backward_from_delta", "Config", "PassConfig"]

f32 = jnp.float32

# Programs wanted in flight for the dV pass (2 per SM of an H100/H200 with 132 SMs).
# Below that, the default kv block of the dV pass shrinks (to 32 at the least).
_TARGET_PROGRAMS = 264


def _and(a, b):
  """``a & b`` where either side may be ``None`` (meaning "all true")."""
  if a is None:
    return b
  if b is None:
    return a
  return a & b


def _outer(rows, cols):
  """2D mask from optional row / column masks (``None`` = all valid)."""
  r = None if rows is None else rows[:, None]
  c = None if cols is None else cols[None, :]
  return _and(r, c)


def _load(ref, mask, other):
  if mask is None:
    return pltriton.load(ref)
  return pltriton.load(ref, mask=mask, other=other)


def _store(ref, val, mask):
  if mask is None:
    pltriton.store(ref, val)
  else:
    pltriton.store(ref, val, mask=mask)


def _store_dv(dv_ref, acc, split, share, bk, k0, block_kv, d_pad, mask):
  """Stores a program's dV block ``acc`` (fp32 ``[block_kv, d_pad]``): in dV's dtype, or with
  ``split > 1`` as this share's fp32 partial sum (:func:`_dv_struct`)."""
  if split == 1:
    _store(dv_ref.at[bk, pl.ds(k0, block_kv), pl.ds(0, d_pad)], acc.astype(dv_ref.dtype), mask)
  else:
    _store(dv_ref.at[share, bk, pl.ds(k0, block_kv), pl.ds(0, d_pad)], acc, mask)


def _share_range(share, steps: int, split: int):
  """``(start, stop)`` of program share ``share`` of a loop of ``steps`` steps cut into
  ``split`` equal shares (the last may be shorter, or empty)."""
  per = pl.cdiv(steps, split)
  start = share * per
  return start, jnp.minimum(start + per, steps)


def _dv_struct(split, value_states, *inputs):
  """The dV output of a kernel whose kv blocks are shared by ``split`` programs: dV itself,
  or ``[split, B*KVH, Skv, D]`` fp32 partial sums (added by :func:`_sum_dv_shares`)."""
  if split == 1:
    return out_struct(value_states.shape, value_states.dtype, *inputs)
  return out_struct((split, *value_states.shape), f32, *inputs)


def _sum_dv_shares(dv, split, dtype):
  return dv if split == 1 else dv.sum(axis=0).astype(dtype)


# --------------------------------------------------------------------------------------
# Pass 1: dV and the partial row sums of delta.
# --------------------------------------------------------------------------------------
def _dv_delta_kernel(*refs, num_heads, num_kv_heads, sq, skv, head_dim, block_q, block_kv,
                     split=1, partials=True):
  """One program = one ``block_kv`` rows of V of one (batch, kv head), and one of
  ``split`` equal shares of the (G heads x Sq tiles) loop.

  Refs (whole arrays, indexed by hand):
    do_ref:    [B, Sq, H, D]       dO in its native layout.
    pd_ref:    [B*H, Sq, Skv]      Pd.
    v_ref:     [B*KVH, Skv, D]     V.
    dv_ref:    [B*KVH, Skv, D]     dV (output); with ``split > 1``: [split, B*KVH, Skv, D]
                                   fp32 partial sums (the caller adds them).
    dpart_ref: [B*H, NKV, Sq]      fp32 rowsum(dPd * Pd) over this program's kv block.

  ``partials=False`` (the dS pass takes each row in one tile and its delta exactly): no V,
  no dPd GEMM and no ``dpart``; refs are ``do, pd, dv``.
  """
  if partials:
    do_ref, pd_ref, v_ref, dv_ref, dpart_ref = refs
  else:
    do_ref, pd_ref, dv_ref = refs
  groups = num_heads // num_kv_heads
  d_pad = next_power_of_2(max(head_dim, 16))
  j = pl.program_id(0)  # kv block: fastest grid axis, so programs sharing dO run together
  bk = pl.program_id(1)  # b * KVH + kvh
  share = pl.program_id(2)
  b = lax.div(bk, num_kv_heads)
  kvh = lax.rem(bk, num_kv_heads)
  k0 = j * block_kv

  d_mask = None if d_pad == head_dim else jnp.arange(d_pad) < head_dim
  kv_mask = None if skv % block_kv == 0 else (k0 + jnp.arange(block_kv)) < skv
  v_tile_mask = _outer(kv_mask, d_mask)
  if partials:
    v = _load(v_ref.at[bk, pl.ds(k0, block_kv), pl.ds(0, d_pad)], v_tile_mask, 0.0)

  nq = pl.cdiv(sq, block_q)
  start, stop = _share_range(share, groups * nq, split)

  def body(i, acc):
    g = lax.div(i, nq)
    qi = lax.rem(i, nq)
    h = kvh * groups + g
    bh = b * num_heads + h
    q0 = qi * block_q
    q_mask = None if sq % block_q == 0 else (q0 + jnp.arange(block_q)) < sq
    do = _load(do_ref.at[b, pl.ds(q0, block_q), h, pl.ds(0, d_pad)], _outer(q_mask, d_mask),
               0.0)
    pd = _load(pd_ref.at[bh, pl.ds(q0, block_q), pl.ds(k0, block_kv)],
               _outer(q_mask, kv_mask), 0.0)
    # dV_j += Pd^T @ dO    [block_kv, d_pad]; padded rows / columns of Pd are 0.
    acc = acc + dot(pd, do, trans_a=True)
    if not partials:
      return acc
    # dPd = dO @ V_j^T     [block_q, block_kv]
    dpd = dot(do, v, trans_b=True)
    part = jnp.sum(dpd * pd.astype(f32), axis=1)
    _store(dpart_ref.at[bh, j, pl.ds(q0, block_q)], part, q_mask)
    return acc

  acc = lax.fori_loop(start, stop, body, jnp.zeros((block_kv, d_pad), f32))
  _store_dv(dv_ref, acc, split, share, bk, k0, block_kv, d_pad, v_tile_mask)


# --------------------------------------------------------------------------------------
# Pass 2: dS = P * (dW - delta).
# --------------------------------------------------------------------------------------
def _ds_refs(refs, mode, has_dpart=True):
  """``(do, p, keep, v, dpart, scale, outputs)`` refs of a dS kernel (inputs as
  :func:`_ds_inputs` orders them); ``keep`` is None when ``mode`` is ``"none"``, ``scale``
  unless it is ``"traced"`` (see :func:`_ds_kernel`), ``dpart`` unless ``has_dpart``;
  ``outputs`` is the list of the remaining (output) refs."""
  refs = list(refs)
  do_ref, p_ref = refs.pop(0), refs.pop(0)
  keep_ref = None if mode == "none" else refs.pop(0)
  v_ref = refs.pop(0)
  dpart_ref = refs.pop(0) if has_dpart else None
  scale_ref = refs.pop(0) if mode == "traced" else None
  return do_ref, p_ref, keep_ref, v_ref, dpart_ref, scale_ref, refs


def _ds_inputs(inputs, keep, value_states, delta, scale, dropout):
  """``inputs`` (dO, P) plus, in the order :func:`_ds_refs` takes them: keep (unless
  ``dropout`` is "none"), V, ``delta`` (partials or row sums; ``None``: not read) and
  scale (if ``dropout`` is "traced")."""
  inputs = list(inputs)
  if dropout[0] != "none":
    inputs.append(keep)
  inputs.append(value_states)
  if delta is not None:
    inputs.append(delta)
  if dropout[0] == "traced":
    inputs.append(scale)
  return inputs


def _ds_kernel(*refs, num_heads, num_kv_heads, sq, skv, head_dim, block_q, block_kv,
               dropout, prefetch=False, heads=1):
  """One program = one ``block_q`` rows of ``heads`` query heads of one kv group (same
  batch); loops over all of Skv. Each V tile is loaded once for the ``heads`` heads.

  ``dropout`` is ``"none"`` (p == 0: keep is not an input), ``"static"`` (python
  float ``p > 0``: ``("static", 1 / (1 - p))``) or ``"traced"`` (keep is read and
  ``scale_ref = [keep_scale, drop_scale]`` fp32 holds ``[1/(1-p), 0]`` or ``[1, 1]``).

  Refs: do [B, Sq, H, D], p [B*H, Sq, Skv], (keep [B*H, Sq, Skv] bool), v [B*KVH, Skv, D],
  dpart [B*H, NKV1, Sq] fp32, (scale [2] fp32), and the output ds [B*H, Sq, Skv].
  """
  mode = dropout[0]
  nkv = pl.cdiv(skv, block_kv)
  do_ref, p_ref, keep_ref, v_ref, dpart_ref, scale_ref, (ds_ref,) = _ds_refs(refs, mode,
                                                                            nkv > 1)

  groups = num_heads // num_kv_heads
  d_pad = next_power_of_2(max(head_dim, 16))
  qi = pl.program_id(0)  # q block: fastest grid axis, so programs sharing V run together
  bh0 = pl.program_id(1) * heads  # b * H + first head; `heads` divides G
  b = lax.div(bh0, num_heads)
  h0 = lax.rem(bh0, num_heads)
  bk = b * num_kv_heads + lax.div(h0, groups)
  q0 = qi * block_q
  rs = range(heads)

  d_mask = None if d_pad == head_dim else jnp.arange(d_pad) < head_dim
  q_mask = None if sq % block_q == 0 else (q0 + jnp.arange(block_q)) < sq
  do = [_load(do_ref.at[b, pl.ds(q0, block_q), h0 + r, pl.ds(0, d_pad)],
              _outer(q_mask, d_mask), 0.0) for r in rs]

  ragged_kv = skv % block_kv != 0
  if nkv == 1:
    # The whole row is one tile: delta = rowsum(dW * P) is computed exactly as the
    # reference does (below), without the rounding of Pd that pass 1's partials carry,
    # which matters most for short rows.
    delta = [None] * heads
  else:
    # delta = rowsum(dPd * Pd) = rowsum(dW * P) under the precondition: sum pass 1's
    # partials, up to 32 of them per (2D) load.
    n_part = dpart_ref.shape[1]
    chunk = min(next_power_of_2(n_part), 32)

    def add_chunk(c, acc, bh):
      rows = c * chunk + jnp.arange(chunk)
      mask = _outer(None if n_part % chunk == 0 else rows < n_part, q_mask)
      part = _load(dpart_ref.at[bh, pl.ds(c * chunk, chunk), pl.ds(q0, block_q)], mask, 0.0)
      return acc + jnp.sum(part, axis=0)

    delta = [lax.fori_loop(0, pl.cdiv(n_part, chunk),
                           functools.partial(add_chunk, bh=bh0 + r),
                           jnp.zeros((block_q,), f32)) for r in rs]

  if mode == "traced":
    keep_scale = scale_ref[0]
    drop_scale = scale_ref[1]

  def kv_mask_of(j, masked):
    return (j * block_kv + jnp.arange(block_kv)) < skv if masked else None

  def load_p_keep(j, masked):
    """``[(P, keep) per head]`` of kv tile ``j``."""
    mask = _outer(q_mask, kv_mask_of(j, masked))
    out = []
    for r in rs:
      idx = (bh0 + r, pl.ds(q0, block_q), pl.ds(j * block_kv, block_kv))
      p = _load(p_ref.at[idx], mask, 0.0)
      keep = (jnp.zeros((), jnp.bool_) if mode == "none"
              else _load(keep_ref.at[idx], mask, False))
      out.append((p, keep))
    return tuple(out)

  def tile(j, masked, pk=None):
    k0 = j * block_kv
    kv_mask = kv_mask_of(j, masked)
    v = _load(v_ref.at[bk, pl.ds(k0, block_kv), pl.ds(0, d_pad)], _outer(kv_mask, d_mask), 0.0)
    mask = _outer(q_mask, kv_mask)
    if pk is None:
      pk = load_p_keep(j, masked)
    for r in rs:
      p, keep = pk[r]
      dw = dot(do[r], v, trans_b=True)  # dPd, [block_q, block_kv] fp32
      if mode == "static":
        dw = jnp.where(keep, dw * dropout[1], 0.0)
      elif mode == "traced":
        dw = dw * jnp.where(keep, keep_scale, drop_scale)
      p = p.astype(f32)
      row_delta = jnp.sum(dw * p, axis=1) if delta[r] is None else delta[r]
      ds = p * (dw - row_delta[:, None])
      _store(ds_ref.at[bh0 + r, pl.ds(q0, block_q), pl.ds(k0, block_kv)],
             ds.astype(ds_ref.dtype), mask)

  def body(j, carry, masked=False):
    tile(j, masked)
    return carry

  if prefetch:
    # Software prefetch in registers: tile j + 1's P and keep are requested before tile
    # j is computed. Rows of odd length cannot use the asynchronous (16-byte) copies
    # Triton pipelines with, so without this each tile would wait for its loads.
    def prefetch_body(j, carry):
      nxt = load_p_keep(j + 1, True)  # past the end: fully masked, touches no memory
      tile(j, True, carry)
      return nxt

    lax.fori_loop(0, nkv, prefetch_body, load_p_keep(h0 * 0, True))
  elif ragged_kv:
    # Unmasked steady state, one masked tail tile (keeps the kv mask out of the hot loop).
    # The tail is a one-trip loop so its start index stays dynamic: a constant start
    # past the end would fail the static slice bounds check of the indexer.
    lax.fori_loop(0, nkv - 1, body, 0)
    lax.fori_loop(nkv - 1, nkv, functools.partial(body, masked=True), 0)
  else:
    lax.fori_loop(0, nkv, body, 0)


def _ds_kernel_phased(*refs, num_heads, num_kv_heads, sq, skv, head_dim, block_q, block_kv,
                      dropout, n_part, align):
  """The dS pass for rows of ``Skv % 8 != 0`` keys, on 16-byte aligned tiles.

  The ``G * Sq`` rows of one kv group (its G query heads, one after the other in memory)
  share V. One program = one row class of them (``block_q`` rows ``align`` apart, see
  ``pallas_kernels._phase``): they all have the same phase, so one shifted V tile serves
  them all, and a class holds ``G * Sq / align`` rows, so short heads still fill tiles.
  Column tile ``j`` covers keys ``[j * BKV - phase, (j + 1) * BKV - phase)``; every load
  of P and keep is of 16-byte vectors (``_phase.tile_masks``), and so is every store of
  dS except those of the few elements at each end of a row (a second, scalar store in the
  two edge tiles). (The rows' delta partials, ``align`` rows apart, load as scalars.)
  The steady-state tiles between the edges take no column masks. (Storing those end
  elements from two 16-wide fix-up tiles after one loop over all tiles measured 5-13%
  slower.)

  Refs as :func:`_ds_kernel`, but every array is a flat 1D view (``scale`` stays ``[2]``);
  ``dpart`` holds ``n_part`` partials per row.
  """
  mode = dropout[0]
  do_ref, p_ref, keep_ref, v_ref, dpart_ref, scale_ref, (ds_ref,) = _ds_refs(refs, mode)

  groups = num_heads // num_kv_heads
  d_pad = next_power_of_2(max(head_dim, 16))
  # u0, u: the tile's first row and its rows, within the group
  cls, u0, u = _phase.class_rows(pl.program_id(0), align, block_q)
  bk = pl.program_id(1)  # b * KVH + kv head
  b = lax.div(bk, num_kv_heads)
  row0 = bk * (groups * sq)  # the group's first row among all B * H * Sq rows
  ph = _phase.phase(row0 + cls, skv, align)
  row_ok = u < groups * sq
  hg = lax.div(u, sq)  # head within the group, per row
  q = lax.rem(u, sq)
  bh = bk * groups + hg
  d = jnp.arange(d_pad, dtype=jnp.int32)
  d_mask = None if d_pad == head_dim else d < head_dim
  base = _phase.aligned_base(row0 + u0, skv, ph, align)
  do = _load(do_ref.at[((b * sq + q) * num_heads + bh - b * num_heads)[:, None] * head_dim
                       + d[None, :]], _outer(row_ok, d_mask), 0.0)

  # delta = rowsum(dPd * Pd) = rowsum(dW * P) under the precondition: pass 1's partials.
  chunk = min(next_power_of_2(n_part), 32)

  def add_chunk(c, acc):
    k = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    offs = (bh[None, :] * n_part + k[:, None]) * sq + q[None, :]
    mask = _outer(None if n_part % chunk == 0 else k < n_part, row_ok)
    return acc + jnp.sum(_load(dpart_ref.at[offs], mask, 0.0), axis=0)

  delta = lax.fori_loop(0, pl.cdiv(n_part, chunk), add_chunk, jnp.zeros((block_q,), f32))

  if mode == "traced":
    keep_scale = scale_ref[0]
    drop_scale = scale_ref[1]

  def ds_tile(j, kv, v_mask, mask):
    """``(flat offsets, dS)`` of column tile ``j`` (keys ``kv``)."""
    v = _load(v_ref.at[(bk * skv + kv)[:, None] * head_dim + d[None, :]],
              _outer(v_mask, d_mask), 0.0)
    offs = _phase.tile_offsets(base, skv, block_q, j * block_kv, block_kv, align)
    p = _load(p_ref.at[offs], mask, 0.0).astype(f32)
    dw = dot(do, v, trans_b=True)  # dPd, [block_q, block_kv] fp32
    if mode == "static":
      dw = jnp.where(_load(keep_ref.at[offs], mask, False), dw * dropout[1], 0.0)
    elif mode == "traced":
      dw = dw * jnp.where(_load(keep_ref.at[offs], mask, False), keep_scale, drop_scale)
    return offs, (p * (dw - delta[:, None])).astype(ds_ref.dtype)

  def body(j, carry, edge=False):
    # V is indexed by hand: tile 0 starts at a negative (masked) key, which a slice clamps.
    kv, valid, load, vector = _phase.tile_masks(j, skv, block_kv, ph)
    if not edge:  # the tile lies inside the rows: no column masks
      offs, ds = ds_tile(j, kv, None, _outer(row_ok, None))
      _store(ds_ref.at[offs], ds, _outer(row_ok, None))
      return carry
    offs, ds = ds_tile(j, kv, valid, _outer(row_ok, load))
    # 16-byte vectors wholly inside the rows, then the rows' first / last few elements.
    _store(ds_ref.at[offs], ds, _outer(row_ok, vector))
    _store(ds_ref.at[offs], ds, _outer(row_ok, valid & jnp.logical_not(vector)))
    return carry

  # Tiles 0 and nt - 1 reach outside the rows; the ones between take no column masks
  # (rows span at least 2 tiles here: the caller checks).
  nt = _phase.num_tiles(skv, block_kv, ph)
  lax.fori_loop(0, 1, functools.partial(body, edge=True), 0)
  lax.fori_loop(1, nt - 1, body, 0)
  lax.fori_loop(nt - 1, nt, functools.partial(body, edge=True), 0)


# --------------------------------------------------------------------------------------
# From delta: one pass for dS and dV (the op's backward, which has delta from its output).
# --------------------------------------------------------------------------------------
def _group_rows_do(do_ref, b, kvh, u, row_mask, d, d_mask, *, sq, num_heads, groups,
                   head_dim):
  """dO of rows ``u`` of a kv group's ``G * Sq`` rows (head ``u // Sq``, query ``u % Sq``),
  gathered from the flat ``[B, Sq, H, D]`` array: ``[len(u), d_pad]``."""
  h = kvh * groups + lax.div(u, sq)
  q = lax.rem(u, sq)
  offs = (((b * sq + q) * num_heads + h) * head_dim)[:, None] + d[None, :]
  return _load(do_ref.at[offs], _outer(row_mask, d_mask), 0.0)


def _ds_dv_kernel(*refs, num_heads, num_kv_heads, sq, skv, head_dim, block_q, block_kv,
                  dropout, split, exact_delta):
  """dS and dV of one ``block_kv`` keys of one kv group, from P and keep alone.

  One program = one kv block of one (batch, kv head) and one of ``split`` shares of the
  loop over the group's ``G * Sq`` rows (its G heads one after the other, so short heads
  still fill tiles). It keeps V's block and an fp32 dV accumulator on chip; per tile of
  rows it reads P and keep, recomputes ``dPd = dO @ V^T``, writes
  ``dS = P * (dW - delta)`` and rebuilds ``Pd = round(P * keep / (1 - p))`` (the
  precondition) for ``dV += Pd^T @ dO``. ``exact_delta`` (a row is one kv block): delta
  is ``rowsum(dW * P)`` of the tile, exactly as the reference, and no delta is read.

  Refs: do flat ``[B*Sq*H*D]``, p ``[B*KVH, G*Sq, Skv]``, (keep, same), v
  ``[B*KVH, Skv, D]``, (delta ``[B*KVH, G*Sq]`` fp32 unless ``exact_delta``), (scale
  ``[2]`` fp32 if ``dropout`` is traced, see :func:`_ds_kernel`); outputs ds (as p), dv
  ``[B*KVH, Skv, D]`` (``split > 1``: ``[split, B*KVH, Skv, D]`` fp32 partial sums).
  """
  mode = dropout[0]
  do_ref, p_ref, keep_ref, v_ref, delta_ref, scale_ref, (ds_ref, dv_ref) = _ds_refs(
      refs, mode, not exact_delta)

  groups = num_heads // num_kv_heads
  rows = groups * sq
  d_pad = next_power_of_2(max(head_dim, 16))
  j = pl.program_id(0)  # kv block: fastest grid axis, so programs sharing dO run together
  bk = pl.program_id(1)
  share = pl.program_id(2)
  b = lax.div(bk, num_kv_heads)
  kvh = lax.rem(bk, num_kv_heads)
  k0 = j * block_kv
  d = jnp.arange(d_pad, dtype=jnp.int32)
  d_mask = None if d_pad == head_dim else d < head_dim
  kv_mask = None if skv % block_kv == 0 else (k0 + jnp.arange(block_kv)) < skv
  v_tile_mask = _outer(kv_mask, d_mask)
  v = _load(v_ref.at[bk, pl.ds(k0, block_kv), pl.ds(0, d_pad)], v_tile_mask, 0.0)
  if mode == "traced":
    keep_scale = scale_ref[0]
    drop_scale = scale_ref[1]

  def body(i, acc, masked=False):
    r0 = i * block_q
    u = r0 + jnp.arange(block_q, dtype=jnp.int32)
    row_mask = u < rows if masked else None
    mask = _outer(row_mask, kv_mask)
    do = _group_rows_do(do_ref, b, kvh, u, row_mask, d, d_mask, sq=sq,
                        num_heads=num_heads, groups=groups, head_dim=head_dim)
    idx = (bk, pl.ds(r0, block_q), pl.ds(k0, block_kv))
    p = _load(p_ref.at[idx], mask, 0.0)
    pf = p.astype(f32)
    dpd = dot(do, v, trans_b=True)  # [block_q, block_kv] fp32
    if mode == "none":
      dw, pd = dpd, p
    else:
      keep = _load(keep_ref.at[idx], mask, False)
      if mode == "static":
        dw = jnp.where(keep, dpd * dropout[1], 0.0)
        pd = jnp.where(keep, pf * dropout[1], 0.0).astype(p.dtype)
      else:
        s = jnp.where(keep, keep_scale, drop_scale)
        dw = dpd * s
        pd = (pf * s).astype(p.dtype)
    if exact_delta:
      delta = jnp.sum(dw * pf, axis=1)
    else:
      delta = _load(delta_ref.at[bk, pl.ds(r0, block_q)], row_mask, 0.0)
    _store(ds_ref.at[idx], (pf * (dw - delta[:, None])).astype(ds_ref.dtype), mask)
    # dV_j^T += dO^T @ Pd: Pd, made in registers, is the GEMM's B operand as it is
    # (as the A operand of Pd^T @ dO it needs a transpose: 1688 vs 2070 us at (4, 1024, 2048)).
    return acc + dot(do, pd, trans_a=True)

  n_tiles = pl.cdiv(rows, block_q)
  start, stop = _share_range(share, n_tiles, split)
  acc = jnp.zeros((d_pad, block_kv), f32)  # dV_j^T
  if rows % block_q:
    # Only the last tile of rows is ragged: the share holding it runs it masked.
    full = n_tiles - 1
    acc = lax.fori_loop(start, jnp.minimum(stop, full), body, acc)
    acc = lax.fori_loop(jnp.maximum(start, full), stop, functools.partial(body, masked=True),
                        acc)
  else:
    acc = lax.fori_loop(start, stop, body, acc)
  acc = acc.T
  _store_dv(dv_ref, acc, split, share, bk, k0, block_kv, d_pad, v_tile_mask)


# --------------------------------------------------------------------------------------
# Launch configuration.
# --------------------------------------------------------------------------------------
class PassConfig(NamedTuple):
  """Tiles and Triton launch parameters of one pass (tiles: powers of two >= 16).

  ``prefetch`` (dS pass only): load the next tile's P and keep while computing this one
  (a dV-pass prefetch of dO and Pd measured slower). ``split`` (dV pass only): programs
  that share one kv block's loop over the G heads and Sq tiles, each adding an fp32
  partial dV (for launches with too few kv blocks to fill the GPU); 0 = ``auto_split``.
  ``heads`` (dS pass only): query heads of one kv group per program, so each V tile is
  loaded once for all of them (the largest divisor of G that is <= ``heads`` is used).
  ``row_align`` (dS pass only): rows of ``Skv % 8 != 0`` keys take aligned tiles of every
  ``row_align``-th row of a kv group (``_ds_kernel_phased``; ``prefetch`` and ``heads``
  are then unused: its tiles already mix the group's heads): 8, 16, 32 or 64 (at most
  ``block_kv``); -1 = ``_phase.choose``; 0 = off (tiles of consecutive rows, scalar
  loads). Used only where rows span more than one kv tile.
  """
  block_q: int
  block_kv: int
  num_warps: int
  num_stages: int
  prefetch: bool = False
  split: int = 0
  heads: int = 1
  row_align: int = -1


class Config(NamedTuple):
  """``dv``: the dV + delta pass; ``ds``: the dS pass."""
  dv: PassConfig
  ds: PassConfig


_KERNEL = "attention_softmax_dropout_value"


def length_class(skv: int) -> str:
  """The tuning table's key for rows of ``skv`` keys (see ``_tuning.tile_length_class``)."""
  return _tuning.tile_length_class(skv)


def _heuristic(b, h, kvh, sq, skv, d, itemsize) -> Config:
  """Untuned defaults: 64 x 64 tiles (fp32 with D > 64: 32 query rows), 4-8 warps."""
  d_pad = next_power_of_2(max(d, 16))
  cap_q = max(16, next_power_of_2(sq))
  cap_kv = max(16, next_power_of_2(skv))
  block_q = min(32 if itemsize >= 4 and d_pad >= 128 else 64, cap_q)
  block_kv = min(128 if d_pad <= 64 else 64, cap_kv)
  num_warps = 4 if max(block_q, block_kv) * d_pad <= 64 * 128 else 8
  num_stages = 2 if d_pad >= 128 else 3
  # Both passes take the same tiles; small dV-pass launches split each kv block's loop
  # over several programs (PassConfig.split = 0: auto_split).
  cfg = PassConfig(block_q, block_kv, num_warps, num_stages)
  return Config(cfg, cfg)


def default_config(b, h, kvh, sq, skv, d, dtype, device_kind=None) -> Config:
  """The tuned config (bf16/fp16, D <= 128, on the device it was tuned on), else a heuristic.

  Tuned tiles are capped at the padded lengths, so short sequences get smaller tiles.
  """
  itemsize = jnp.dtype(dtype).itemsize
  tuned = _tuning.lookup(_tuning.table(_KERNEL, device_kind or ""), length_class(skv))
  if not tuned or itemsize > 2 or next_power_of_2(d) > 128:
    return _heuristic(b, h, kvh, sq, skv, d, itemsize)
  cap_q = max(16, next_power_of_2(sq))
  cap_kv = max(16, next_power_of_2(skv))
  def cap(c):
    return PassConfig(min(c[0], cap_q), min(c[1], cap_kv), *c[2:])
  return Config(cap(tuned["dv"]), cap(tuned["ds"]))


# --------------------------------------------------------------------------------------
# The two passes (each jitted on its own so it can be timed and tuned alone).
# --------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=["num_heads", "cfg", "interpret", "partials"])
def dv_pass(grad_attn_output, attn_weights_dropped, value_states, *, num_heads, cfg, interpret,
            partials=True):
  """Pass 1: ``(dV [B*KVH, Skv, D], delta partials [B*H, cdiv(Skv, block_kv), Sq] fp32)``;
  with ``partials=False``: ``(dV, None)`` (no dPd GEMM, V is not read).

  ``attn_weights_dropped`` is ``[B*H, Sq, Skv]``, ``value_states`` ``[B*KVH, Skv, D]``.
  """
  b, sq, h, d = grad_attn_output.shape
  bkvh, skv, _ = value_states.shape
  kvh = bkvh // b
  n_kv = pl.cdiv(skv, cfg.block_kv)
  split = cfg.split or auto_split(b, h, kvh, sq, skv, cfg.block_q, cfg.block_kv)
  inputs = (grad_attn_output, attn_weights_dropped, value_states)
  dv_struct = _dv_struct(split, value_states, *inputs)
  if not partials:
    inputs = inputs[:2]
  out = pallas_call(
      functools.partial(_dv_delta_kernel, num_heads=num_heads, num_kv_heads=kvh, sq=sq,
                        skv=skv, head_dim=d, block_q=cfg.block_q, block_kv=cfg.block_kv,
                        split=split, partials=partials),
      out_shape=((dv_struct, out_struct((b * h, n_kv, sq), f32, *inputs)) if partials
                 else (dv_struct,)),
      grid=(n_kv, bkvh, split),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="attention_dropout_value_bwd_dv" if partials else "attention_dropout_value_bwd_dv_only",
  )(*inputs)
  dpart = out[1] if partials else None
  return _sum_dv_shares(out[0], split, value_states.dtype), dpart


def auto_split(b, h, kvh, sq, skv, block_q, block_kv) -> int:
  """``PassConfig.split`` when it is 0: doubles while the dV pass's launch stays within
  ``_TARGET_PROGRAMS`` programs and each share keeps at least 2 steps of its loop."""
  return _auto_split(b * kvh * pl.cdiv(skv, block_kv), (h // kvh) * pl.cdiv(sq, block_q))


def _auto_split(programs, steps) -> int:
  """:func:`auto_split` for a launch of ``programs`` programs of ``steps`` loop steps."""
  split = 1
  while programs * split * 2 <= _TARGET_PROGRAMS and steps >= split * 4:
    split *= 2
  return split


def group_heads(groups: int, wanted: int) -> int:
  """The dS pass's heads per program: the largest divisor of ``groups`` <= ``wanted``."""
  return max(n for n in range(1, max(1, min(wanted, groups)) + 1) if groups % n == 0)


@functools.partial(jax.jit, static_argnames=["num_heads", "dropout", "cfg", "interpret"])
def ds_pass(grad_attn_output, attn_weights, keep, value_states, dpart, scale, *, num_heads,
            dropout, cfg, interpret):
  """Pass 2: ``dS [B*H, Sq, Skv]``; ``keep`` / ``scale`` are unused (may be None) as
  ``dropout`` says (see ``_ds_kernel``)."""
  b, sq, h, d = grad_attn_output.shape
  bkvh, skv, _ = value_states.shape
  one_tile = skv <= cfg.block_kv  # delta in the tile: dpart is not read (may be None)
  inputs = _ds_inputs([grad_attn_output, attn_weights], keep, value_states,
                      None if one_tile else dpart, scale, dropout)
  groups = h // (bkvh // b)
  if not one_tile and use_phased(cfg, b, h, sq, skv, d, dpart.size, value_states.size):
    # Flat views (free reshapes) for the phase-aligned tiles of _ds_kernel_phased.
    flat = [x if x is None or x.ndim < 2 else x.reshape(-1) for x in inputs]
    # Only tile 0 is peeled for the row starts: phase < align <= block_kv.
    align, block_q = _phase.resolve(cfg.row_align, groups * sq, cfg.block_q, cfg.block_kv)
    ds = pallas_call(
        functools.partial(_ds_kernel_phased, num_heads=num_heads, num_kv_heads=bkvh // b,
                          sq=sq, skv=skv, head_dim=d, block_q=block_q,
                          block_kv=cfg.block_kv, dropout=dropout, n_part=dpart.shape[1],
                          align=align),
        out_shape=out_struct((b * h * sq * skv,), attn_weights.dtype, *inputs),
        grid=(_phase.num_programs(groups * sq, align, block_q), bkvh),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="attention_dropout_value_bwd_ds_aligned",
    )(*flat)
    return ds.reshape(b * h, sq, skv)
  heads = group_heads(groups, cfg.heads)
  return pallas_call(
      functools.partial(_ds_kernel, num_heads=num_heads, num_kv_heads=bkvh // b, sq=sq,
                        skv=skv, head_dim=d, block_q=cfg.block_q, block_kv=cfg.block_kv,
                        dropout=dropout, prefetch=cfg.prefetch, heads=heads),
      out_shape=out_struct((b * h, sq, skv), attn_weights.dtype, *inputs),
      grid=(pl.cdiv(sq, cfg.block_q), b * h // heads),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="attention_dropout_value_bwd_ds",
  )(*inputs)


def use_phased(cfg, b, h, sq, skv, d, *sizes) -> bool:
  """Whether the dS pass runs :func:`_ds_kernel_phased`: ``cfg.row_align`` is not 0, rows are not
  16-byte aligned (``Skv % 8 != 0``), a row spans more than one kv tile (one-tile rows
  keep the exact in-tile delta) and the flat views fit int32 offsets."""
  return _phase.applies(cfg.row_align, skv, cfg.block_kv, b * h * sq * skv, b * sq * h * d,
                        *sizes)


@functools.partial(jax.jit, static_argnames=["num_heads", "dropout", "cfg", "interpret"])
def ds_dv_pass(grad_attn_output, attn_weights, keep, value_states, delta, scale, *, num_heads,
               dropout, cfg, interpret):
  """``(dS [B*KVH, G*Sq, Skv], dV [B*KVH, Skv, D])`` from P, keep and delta, one kernel.

  ``attn_weights`` and ``keep`` are ``[B*KVH, G*Sq, Skv]`` (a kv group's heads one after
  the other); ``delta`` is ``[B*KVH, G*Sq]`` fp32, unused (may be None) where
  ``cfg.block_kv >= Skv``; ``keep`` / ``scale`` as ``dropout`` says (see ``_ds_kernel``).
  """
  b, sq, h, d = grad_attn_output.shape
  bkvh, rows, skv = attn_weights.shape
  kvh = bkvh // b
  exact_delta = skv <= cfg.block_kv
  n_kv = pl.cdiv(skv, cfg.block_kv)
  split = cfg.split or _auto_split(bkvh * n_kv, pl.cdiv(rows, cfg.block_q))
  inputs = _ds_inputs([grad_attn_output.reshape(-1), attn_weights], keep, value_states,
                      None if exact_delta else delta, scale, dropout)
  ds, dv = pallas_call(
      functools.partial(_ds_dv_kernel, num_heads=num_heads, num_kv_heads=kvh, sq=sq, skv=skv,
                        head_dim=d, block_q=cfg.block_q, block_kv=cfg.block_kv,
                        dropout=dropout, split=split, exact_delta=exact_delta),
      out_shape=(out_struct(attn_weights.shape, attn_weights.dtype, *inputs),
                 _dv_struct(split, value_states, *inputs)),
      grid=(n_kv, bkvh, split),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="attention_dropout_value_bwd_ds_dv",
  )(*inputs)
  return ds, _sum_dv_shares(dv, split, value_states.dtype)


def _dropout_args(p_static, p_traced):
  """``(dropout mode, scale array or None)`` for ``ds_pass``."""
  if p_static == 0.0:
    return ("none",), None
  if p_static is not None:
    return ("static", dropout_scale(p_static)), None
  pt = jnp.asarray(p_traced, f32)
  on = pt > 0
  # An invalid traced rate (outside [0, 1), NaN) gives NaN grad_attn_scores, not wrong ones.
  # Both scales, so that dropped elements (and rows whose delta is read) are NaN too.
  inv = _checks.nan_unless_rate_valid(pt, jnp.where(on, 1.0 / (1.0 - pt), 1.0))
  drop = _checks.nan_unless_rate_valid(pt, jnp.where(on, 0.0, 1.0))
  scale = jnp.stack([inv, drop])
  return ("traced",), scale.astype(f32)


@functools.partial(jax.jit, static_argnames=["p_static", "config", "interpret"])
def _backward(grad_attn_output, attn_weights, attn_weights_dropped, value_states,
              dropout_mask, p_traced, delta=None, *, p_static, config, interpret):
  b, h, sq, skv = attn_weights.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  # Free (bitcast) reshapes to 3D views; dO stays [B, Sq, H, D].
  p3 = attn_weights.reshape(b * h, sq, skv)
  pd3 = attn_weights_dropped.reshape(b * h, sq, skv)
  v3 = value_states.reshape(b * kvh, skv, d)
  # Pass 1 makes delta's partials only when the dS pass needs them: not for rows that fit
  # one dS tile (delta in the tile), nor when delta is given (one "partial" per row).
  partials = skv > config.ds.block_kv and delta is None
  dv, dpart = dv_pass(grad_attn_output, pd3, v3, num_heads=h, cfg=config.dv,
                      interpret=interpret, partials=partials)
  if delta is not None:
    dpart = delta.reshape(b * h, 1, sq)
  dropout, scale = _dropout_args(p_static, p_traced)
  keep = None if dropout[0] == "none" else dropout_mask.reshape(b * h, sq, skv)
  ds = ds_pass(grad_attn_output, p3, keep, v3, dpart, scale, num_heads=h, dropout=dropout,
               cfg=config.ds, interpret=interpret)
  return ds.reshape(b, h, sq, skv), dv.reshape(b, kvh, skv, d)


def attention_softmax_dropout_value_backward(
    grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
    attention_dropout, *, delta=None, config: Config | None = None, block_q=None,
    block_kv=None, num_warps=None, num_stages=None, interpret=False):
  """Backward of ``O = transpose(dropout(P) @ V)`` with GQA, as two Pallas Triton kernels.

  Args:
    grad_attn_output: ``[B, Sq, H, D]`` dO.
    attn_weights: ``[B, H, Sq, Skv]`` softmax output P.
    attn_weights_dropped: ``[B, H, Sq, Skv]`` Pd, the weights after dropout.
    value_states: ``[B, KVH, Skv, D]`` V, with ``H % KVH == 0`` (``G = H // KVH``
      query heads share kv head ``h // G``).
    dropout_mask: ``[B, H, Sq, Skv]`` bool, True = kept. Never read when the rate is a
      concrete 0 (its content does not matter then; its shape and dtype are checked).
    attention_dropout: dropout rate p in [0, 1): a Python float / concrete scalar (the
      branch on p is static; each distinct value compiles once) or a traced scalar
      (then the mask is always read, and p == 0 still ignores it; a traced p outside
      [0, 1) gives NaN ``grad_attn_scores``, since nothing can raise at run time).
    delta: optional ``[B, H, Sq]`` fp32, ``rowsum(dPd * Pd)`` of each row, if the caller
      has it: ``rowsum(dO * O)`` for the forward's fp32 output ``O = Pd @ V``
      (:func:`delta_from_output`). Pass 1 then makes only dV, without its dPd GEMM (about
      half its time: 394 vs 736 us at (32, 512, 512), H200). Rows that fit one dS tile
      do not read it (their delta is computed in the tile).
    config: tiles and launch parameters of each pass (:class:`Config`). Default: the
      table ``tuned/attention_softmax_dropout_value.json`` measured on an H200 (for
      16-bit inputs with D <= 128 on that device), else a heuristic (64 x 64 tiles).
    block_q, block_kv, num_warps, num_stages: override one field of both passes'
      configs (tiles: powers of two >= 16).
    interpret: run the kernels in the Pallas interpreter (CPU testing).

  Returns:
    ``(grad_attn_scores [B, H, Sq, Skv], grad_value_states [B, KVH, Skv, D])`` in the
    input dtype (bf16 is the target; float16 and float32 work too, computed in fp32
    with fp32 accumulation; fp32 dots are IEEE, not TF32).

  Precondition (true of every real forward): ``Pd == round(P * keep / (1 - p))`` in the
  input dtype (``Pd == P`` when p == 0). It lets ``delta = rowsum(dW * P)`` be computed
  as ``rowsum(dPd * Pd)``, so the first pass needs neither P nor the mask. The two
  agree up to the rounding of Pd (one bf16 ulp per element, averaged over the row). Rows
  that fit one kv tile of the dS pass (short rows, where that averaging is weakest) take
  delta from dW and P in that pass instead, exactly as the reference.

  Design: the memory floor is reading P and Pd (2 B each in bf16) and keep (1 B) and
  writing dS (2 B): 7 B per attention element; dO and V are O(D) per row and stay in
  L2. Two kernels reach it, each streaming one of P / Pd exactly once:

  1. dV + partial delta, grid ``(cdiv(Skv, BKV), B*KVH)`` (kv block fastest, so the
     programs reading the same dO tiles run together). A program keeps its V block and
     an fp32 dV accumulator on chip, loops over the G heads of its group and the Sq
     tiles, reading Pd once: ``dV += Pd^T @ dO``, ``dPd = dO @ V^T`` and stores
     ``rowsum(dPd * Pd)`` of its kv block to a small fp32 scratch
     ``[B*H, cdiv(Skv, BKV), Sq]`` (4 / BKV B per element). The GQA sum over the group
     happens in the accumulator: no atomics, no [B, H, Skv, D] intermediate. When the dS
     pass does not read the partials (rows in one dS tile, as the tuned table has for
     rows of <= 128 keys, or ``delta`` given), pass 1 only makes dV: without the dPd GEMM
     it takes 53-78% of the time (``benchmarks/results/attention_dv_only.log``).
  2. dS, grid ``(cdiv(Sq, BQ), B*H / heads)`` (q block fastest, so programs sharing V
     run together). A program takes ``PassConfig.heads`` query heads of one kv group
     (1, or 2 in the tuned table for aligned rows of more than 256 keys), loads their dO tiles once,
     sums the delta partials of its rows, then loops over Skv: loads the V tile once for
     its heads, recomputes ``dPd = dO @ V^T`` on the tensor cores (cheaper than storing
     and re-reading it, which would add 8 B per element), reads P and the mask and
     writes ``dS = P * (dPd * keep / (1 - p) - delta)``.

  Ragged Sq / Skv and head dims that are not powers of two are handled by padded
  tiles with masked loads and stores.

  What it achieves (H200, Seed-OSS shapes H=80, KVH=8, D=128, p=0.1;
  ``benchmarks/results/attention_softmax_dropout_value.md``): DRAM traffic is the 7 B
  floor plus ~4 / BKV B of delta partials, but time is 49.0% of the floor in geomean
  (26-61% per workload; XLA 28%), 1.30-2.10x faster than XLA (10 workloads at 48edbcb;
  the three of rows of 128 keys at 724edce, with one-tile dS rows; the three of rows of
  >= 1024 keys at b51c9e1, with 128 x 128 tiles in pass 1). Nsight
  Compute shows both passes latency-bound at 8-16 warps per SM (registers and shared
  memory), at 15-53% of DRAM bandwidth
  (``benchmarks/results/attention_softmax_dropout_value_profile.log``). Launches with few kv
  blocks (B*KVH = 8) split pass 1's loop over 2-4 programs (``auto_split``): (1, 512, 512)
  went from 110 to 82 us. Two heads per dS program brought 4096 x 4096 from 4090 to
  3862 us and (4, 1024, 2048) from 2052 to 1958 us (at 7274b48; 3878 and 1952 us at
  48edbcb).

  Where the dS pass's time goes (4, 1024, 2048; 64-query tiles; measured by removing one
  part at a time, ``benchmarks/results/attention_softmax_dropout_value_tune_heads.log``
  and ``attention_l2_hints.log``): streaming alone (no GEMM, no V) takes 1198 us with
  64-key tiles but 889-941 us with 128-256-key tiles (~88% of the copy rate), so 64-byte
  row segments cost ~25%; re-reading V from L2 once per query tile costs ~15% (1337 ->
  1135 us with 128-key tiles), which ``heads`` halves; summing the delta partials ~3%;
  the rest is the GEMM and its layout conversions not overlapping the stream. Why not
  more: per element the passes run 6*D = 768 tensor-core flops (the dPd GEMM twice) against 7 B,
  close enough to the H200's ridge that the dS pass must overlap its GEMM with streaming
  P / keep / dS, which Triton's software pipelining does only in part (pass 1 runs at
  ~470 TFLOP/s, pass 2 at ~60% of its bandwidth share on aligned shapes).

  Rows whose length is not a multiple of 8 (Skv = 293, 449, 773) are not 16-byte
  aligned: tiles of consecutive rows load with scalar 2-byte accesses that Triton cannot
  pipeline (a plain copy of 449-key rows streams at 1.8 TB/s instead of 4.0). The dS
  pass then takes row classes (``_ds_kernel_phased``, ``pallas_kernels._phase``): every
  ``align``-th row of a kv group starts at the same offset modulo ``align`` elements, so
  its tiles, started that many keys early, are 16- to 128-byte aligned (the copy: 2.8 TB/s
  at 16 bytes, 3.3 at 128). That took the dS pass of (8, 373, 449) from 361 to 311 us and
  of (32, 691, 773) from 4256 to 3706 us (whole backward: 590 -> 522 us, 6769 -> 6127
  us; ``benchmarks/results/attention_ragged_rows.log``). The dV pass keeps scalar
  loads: its accumulator is indexed by key, and a row class's tiles are shifted by its
  phase; moving them back takes a shift on the tensor cores, which for kernel C's column
  kernel (the same structure) measured slower than the scalar loads.

  Also measured and dropped (``benchmarks/results/attention_from_delta.log``): a delta
  pass (``rowsum(dO * (Pd @ V))``, 2 B per element at ~3.7 TB/s on long rows) followed by
  the one kernel of :func:`attention_softmax_dropout_value_backward_from_delta` (P and
  keep in, dS and dV out): 0.78-0.95x the speed of these two passes on five workloads.
  That kernel pays where delta comes for free: the op, which keeps its forward's output.
  """
  p = _checks.check_problem_a(grad_attn_output, attn_weights, attn_weights_dropped,
                              value_states, dropout_mask, attention_dropout)
  p_traced = None if p is not None else attention_dropout
  if delta is not None:
    _checks.check_array("delta", delta, ("B", "H", "Sq"), attn_weights.shape[:3],
                        dtypes=(f32,))
  if config is None:
    b, h, sq, skv = attn_weights.shape
    kvh, d = value_states.shape[1], value_states.shape[3]
    device_kind = None if interpret else jax.devices()[0].device_kind
    config = default_config(b, h, kvh, sq, skv, d, attn_weights.dtype, device_kind)
  config = _tuning.with_overrides(config, block_q=block_q, block_kv=block_kv,
                                  num_warps=num_warps, num_stages=num_stages)
  return _backward(grad_attn_output, attn_weights, attn_weights_dropped, value_states,
                   dropout_mask, p_traced, delta, p_static=p, config=config,
                   interpret=interpret)


def delta_from_output(grad_attn_output, attn_output_f32):
  """``delta = rowsum(dO * O) = rowsum(dPd * Pd)``, ``[B, H, Sq]`` fp32, from dO
  ``[B, Sq, H, D]`` and the forward's fp32 output ``O = Pd @ V`` (before its rounding):
  the ``delta`` of :func:`attention_softmax_dropout_value_backward_from_delta`."""
  return jnp.einsum("bqhd,bqhd->bhq", grad_attn_output.astype(f32), attn_output_f32,
                    precision=lax.Precision.HIGHEST)


def default_from_delta_config(sq, skv, d, dtype) -> PassConfig:
  """The one kernel of :func:`attention_softmax_dropout_value_backward_from_delta`: 64 x 64
  tiles, 4 warps, 3 stages for 16-bit inputs (the fastest of the 12 configs timed with dV
  accumulated transposed, as here, on three workloads,
  ``benchmarks/results/attention_from_delta.log``), the heuristic for fp32."""
  if jnp.dtype(dtype).itemsize > 2:
    return _heuristic(1, 1, 1, sq, skv, d, jnp.dtype(dtype).itemsize).dv
  return PassConfig(64, min(64, max(16, next_power_of_2(skv))), 4, 3)


@functools.partial(jax.jit, static_argnames=["p_static", "cfg", "interpret"])
def _backward_from_delta(grad_attn_output, attn_weights, value_states, dropout_mask, delta,
                         p_traced, *, p_static, cfg, interpret):
  b, h, sq, skv = attn_weights.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  rows = (b * kvh, (h // kvh) * sq, skv)  # free reshapes: a kv group's rows, head by head
  dropout, scale = _dropout_args(p_static, p_traced)
  keep = None if dropout[0] == "none" else dropout_mask.reshape(rows)
  ds, dv = ds_dv_pass(grad_attn_output, attn_weights.reshape(rows), keep,
                      value_states.reshape(b * kvh, skv, d), delta.reshape(rows[:2]), scale,
                      num_heads=h, dropout=dropout, cfg=cfg, interpret=interpret)
  return ds.reshape(b, h, sq, skv), dv.reshape(b, kvh, skv, d)


def attention_softmax_dropout_value_backward_from_delta(
    grad_attn_output, attn_weights, value_states, dropout_mask, attention_dropout, delta, *,
    config: PassConfig | None = None, interpret=False):
  """The same backward as :func:`attention_softmax_dropout_value_backward`, given
  ``delta`` instead of Pd: one kernel that reads P and keep and writes dS (5 B per
  attention element instead of 7) and computes dV on the way.

  A differentiable op that keeps its forward's output has delta for ``O(B*H*Sq*D)``:
  ``delta = rowsum(dO * O) = rowsum(dPd * Pd)`` with O the fp32 (unrounded) output
  ``Pd @ V`` (``jax_ops.attention_softmax_dropout_value`` does this with its Pallas
  backward, and saves P, keep and O instead of P and Pd).

  Args:
    grad_attn_output: ``[B, Sq, H, D]`` dO.
    attn_weights: ``[B, H, Sq, Skv]`` P.
    value_states: ``[B, KVH, Skv, D]`` V, ``H % KVH == 0``.
    dropout_mask: ``[B, H, Sq, Skv]`` bool, True = kept; may be None when the rate is a
      concrete 0.
    attention_dropout: p in [0, 1): a Python float or a traced scalar (a traced p
      outside [0, 1) gives NaN outputs).
    delta: ``[B, H, Sq]`` fp32, ``rowsum(dPd * Pd)`` of each row (above). Rows that fit one
      kv tile (``Skv <= config.block_kv``) do not read it: their delta is
      ``rowsum(dW * P)`` of the tile, exactly as the reference.
    config: the kernel's tiles (a :class:`PassConfig`; its ``split`` as in the dV pass);
      default :func:`default_from_delta_config`.
    interpret: run in the Pallas interpreter (CPU testing).

  Returns:
    ``(grad_attn_scores [B, H, Sq, Skv], grad_value_states [B, KVH, Skv, D])``.

  Precondition: ``Pd == round(P * keep * (1 / (1 - p)))`` with ``1 / (1 - p)`` computed in
  fp32, the forward's Pd, which the kernel rebuilds for dV instead of reading it (the
  ops' forward makes Pd exactly so; a Pd off by an ulp in a quarter of its elements, as
  XLA made when it skipped the rounding of P, left 3.5% of dV outside the spec's
  tolerance).

  Design: one program per ``block_kv`` keys of a (batch, kv head), looping over the
  group's ``G * Sq`` rows: ``dPd = dO @ V^T``, ``dS = P * (dW - delta)``,
  ``dV^T += dO^T @ Pd``. Two GEMMs per element against 5 B: at 64 x 64 tiles it streams at
  about half the copy rate (1688 us for the 3.4 GB of (4, 1024, 2048), H200). With delta
  from the op's saved output it is 4-13% faster than the two-kernel backward on rows of
  >= 512 keys that are a multiple of 8, slower on shorter rows, and 2.3x slower on rows of
  ``Skv % 8 != 0`` keys, which its column tiles load element by element
  (``benchmarks/results/attention_softmax_dropout_value_from_delta.md``).
  """
  p = _checks.check_problem_a(grad_attn_output, attn_weights, None, value_states,
                              dropout_mask, attention_dropout, takes_pd=False)
  b, h, sq, skv = attn_weights.shape
  _checks.check_array("delta", delta, ("B", "H", "Sq"), (b, h, sq), dtypes=(f32,))
  if grad_attn_output.size >= 2**31:
    raise ValueError(f"grad_attn_output: at most 2**31 - 1 elements (int32 offsets), got "
                     f"shape {grad_attn_output.shape}")
  cfg = config or default_from_delta_config(sq, skv, value_states.shape[3],
                                            attn_weights.dtype)
  cfg = _tuning.with_overrides(Config(cfg, cfg)).dv
  return _backward_from_delta(grad_attn_output, attn_weights, value_states, dropout_mask,
                              delta, None if p is not None else attention_dropout,
                              p_static=p, cfg=cfg, interpret=interpret)
