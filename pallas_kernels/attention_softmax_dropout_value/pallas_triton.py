"""Pallas Triton kernels: backward of ``O = transpose(dropout(softmax) @ V)`` with GQA.

The forward this differentiates is::

    P  = softmax(scores)                          # [B, H, seq_q, seq_k]  attn_weights
    Pd = dropout(P) = P * keep / (1 - p)          # [B, H, seq_q, seq_k]  attn_weights_dropped
    O  = transpose(Pd @ repeat(V, G, axis=1))     # [B, seq_q, H, D]      (G = H // KVH)

and the backward, given ``dO = grad_attn_output``, is::

    dPd    = dO[b, :, h, :] @ V[b, h // G]^T                 (fp32 accumulation)
    dW     = dPd * keep / (1 - p)                           (p == 0: dW = dPd)
    delta  = rowsum(dW * P)                                  (over seq_k)
    dS     = P * (dW - delta)                                -> grad_attn_scores
    dV[k]  = sum_{h in group k} Pd[h]^T @ dO[h]               -> grad_value_states

Top to bottom: helpers shared with :mod:`.pallas_triton_from_delta`, then the two passes of
:func:`attention_softmax_dropout_value_backward` (dV, then dS; 7 B per attention element: Pd
read by the first, P and keep by the second, dS written) and that entry point. The design:
``docs/attention_softmax_dropout_value.md``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton_tiles as tiles
from pallas_kernels import _phase, _tuning, validation
from pallas_kernels._util import (Dropout, check_can_compile, compiler_params, dot,
                                  next_power_of_2, out_struct, pallas_call)
from pallas_kernels.attention_softmax_dropout_value.config import (
    Config, PassConfig, default_config, group_heads, resolve_split, use_phased)

f32 = jnp.float32
i32 = np.int32  # index constants: int32 under x64 too (the kernels index with int32)


# --------------------------------------------------------------------------------------
# Small helpers: masks, masked loads and stores, dropout, dV shares.
# --------------------------------------------------------------------------------------


















def _traced_scales(scale_ref):
  """``(keep_scale, drop_scale)`` of a traced rate: ``[1/(1-p), 0]``, or ``[1, 1]`` at p == 0."""
  return scale_ref[0], scale_ref[1]


def _dropout_args(p_static, p_traced):
  """``(Dropout, scale array or None)``: the kernels' static dropout mode, and for a
  traced rate the fp32 ``[keep_scale, drop_scale]`` operand (see :func:`_traced_scales`)."""
  dropout = Dropout.of(p_static)
  if dropout.mode != "traced":
    return dropout, None
  pt = jnp.asarray(p_traced, f32)
  on = pt > 0
  # An invalid traced rate (outside [0, 1), NaN) gives NaN grad_attn_scores, not wrong ones.
  # Both scales, so that dropped elements (and rows whose delta is read) are NaN too.
  inv = validation.nan_unless_rate_valid(pt, jnp.where(on, 1.0 / (1.0 - pt), 1.0))
  drop = validation.nan_unless_rate_valid(pt, jnp.where(on, 0.0, 1.0))
  scale = jnp.stack([inv, drop])
  return dropout, scale.astype(f32)


def _kv_block_ids(num_kv_heads: int, block_k: int):
  """``(j, bk, share, b, kvh, k0)`` of a program of a kv-block grid
  ``(kv block, B*KVH, split)``: kv block ``j`` (the fastest grid axis, so programs sharing
  dO run together) of ``bk = b * KVH + kvh``, share ``share``, first key ``k0``."""
  j = pl.program_id(0)
  bk = pl.program_id(1)
  share = pl.program_id(2)
  b = lax.div(bk, i32(num_kv_heads))
  kvh = lax.rem(bk, i32(num_kv_heads))
  return j, bk, share, b, kvh, j * block_k


def _share_range(share, steps: int, split: int):
  """``(start, stop)`` of program share ``share`` of a loop of ``steps`` steps cut into
  ``split`` equal shares (the last may be shorter, or empty)."""
  per = pl.cdiv(steps, split)
  start = share * per
  return start, jnp.minimum(start + per, steps)


def _dv_struct(split, value_states, *inputs):
  """The dV output of a kernel whose kv blocks are shared by ``split`` programs: dV itself,
  or ``[split, B*KVH, seq_k, D]`` fp32 partial sums (added by :func:`_sum_dv_shares`)."""
  if split == 1:
    return out_struct(value_states.shape, value_states.dtype, *inputs)
  return out_struct((split, *value_states.shape), f32, *inputs)


def _store_dv(dv_ref, acc, split, share, bk, k0, block_k, d_pad, mask):
  """Stores a program's dV block ``acc`` (fp32 ``[block_k, d_pad]``): in dV's dtype, or with
  ``split > 1`` as this share's fp32 partial sum (:func:`_dv_struct`)."""
  if split == 1:
    tiles.store(dv_ref.at[bk, pl.ds(k0, block_k), tiles.head_dims(d_pad)], acc.astype(dv_ref.dtype), mask)
  else:
    tiles.store(dv_ref.at[share, bk, pl.ds(k0, block_k), tiles.head_dims(d_pad)], acc, mask)


def _sum_dv_shares(dv, split, dtype):
  return dv if split == 1 else dv.sum(axis=0).astype(dtype)


# --------------------------------------------------------------------------------------
# Pass 1: dV (and the partial row sums of delta).
# --------------------------------------------------------------------------------------
# One program = one ``block_k`` rows of V of one (batch, kv head), and one of ``split``
# equal shares of the (G heads x seq_q tiles) loop. The GQA sum over the group happens in
# the program's fp32 accumulator: no atomics, no [B, H, seq_k, D] intermediate.
# Refs (whole arrays, indexed by hand): do [B, seq_q, H, D] (dO in its native layout),
# pd [B*H, seq_q, seq_k], v [B*KVH, seq_k, D], dv [B*KVH, seq_k, D] (with ``split > 1``:
# [split, B*KVH, seq_k, D] fp32 partial sums, added by the caller), dpart [B*H, NKV, seq_q]
# fp32 (rowsum(dPd * Pd) over the program's kv block).
def _dv_step(i, do_ref, pd_ref, *, b, kvh, k0, d_mask, kv_mask, nq, num_heads, groups,
             seq_q, block_q, block_k, d_pad):
  """``(bh, q0, q_mask, dO, Pd)`` of loop step ``i`` of a dV program: query tile
  ``i % nq`` of the group's head ``i // nq``."""
  g = lax.div(i, i32(nq))
  qi = lax.rem(i, i32(nq))
  h = kvh * groups + g
  bh = b * num_heads + h
  q0 = qi * block_q
  q_mask = tiles.tail_mask(q0, block_q, seq_q)
  do = tiles.load(do_ref.at[b, pl.ds(q0, block_q), h, tiles.head_dims(d_pad)], tiles.outer(q_mask, d_mask), 0.0)
  pd = tiles.load(pd_ref.at[bh, pl.ds(q0, block_q), pl.ds(k0, block_k)], tiles.outer(q_mask, kv_mask),
             0.0)
  return bh, q0, q_mask, do, pd


class _DvProgram:
  """What a dV program knows of itself: its kv block (``j``, ``bk``, ``k0``) and share of
  the loop (``start``, ``stop``), the block's masks, ``step(i)`` (:func:`_dv_step`), and
  with ``v_ref`` its block of V (``v``)."""

  def __init__(self, do_ref, pd_ref, *, num_heads, num_kv_heads, seq_q, seq_k, head_dim,
               block_q, block_k, split, v_ref=None):
    groups = num_heads // num_kv_heads
    self.d_pad = d_pad = tiles.padded_head_dim(head_dim)
    self.block_k, self.split = block_k, split
    self.j, self.bk, self.share, b, kvh, self.k0 = _kv_block_ids(num_kv_heads, block_k)
    d_mask = tiles.dim_mask(d_pad, head_dim)
    kv_mask = tiles.tail_mask(self.k0, block_k, seq_k)
    self.v_tile_mask = tiles.outer(kv_mask, d_mask)
    if v_ref is not None:
      self.v = tiles.load(v_ref.at[self.bk, pl.ds(self.k0, block_k), tiles.head_dims(d_pad)],
                          self.v_tile_mask, 0.0)
    nq = pl.cdiv(seq_q, block_q)
    self.start, self.stop = _share_range(self.share, groups * nq, split)
    self.step = functools.partial(
        _dv_step, do_ref=do_ref, pd_ref=pd_ref, b=b, kvh=kvh, k0=self.k0, d_mask=d_mask,
        kv_mask=kv_mask, nq=nq, num_heads=num_heads, groups=groups, seq_q=seq_q,
        block_q=block_q, block_k=block_k, d_pad=d_pad)

  def zero_acc(self):
    return jnp.zeros((self.block_k, self.d_pad), f32)

  def store(self, dv_ref, acc):
    _store_dv(dv_ref, acc, self.split, self.share, self.bk, self.k0, self.block_k, self.d_pad,
              self.v_tile_mask)


def _dv_kernel(do_ref, pd_ref, dv_ref, *, num_heads, num_kv_heads, seq_q, seq_k, head_dim,
               block_q, block_k, split):
  """dV alone (the dS pass does not read delta's partials): no V, no dPd GEMM."""
  prog = _DvProgram(do_ref, pd_ref, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    seq_q=seq_q, seq_k=seq_k, head_dim=head_dim, block_q=block_q,
                    block_k=block_k, split=split)

  def body(i, acc):
    _, _, _, do, pd = prog.step(i)
    # dV_j += Pd^T @ dO    [block_k, d_pad]; padded rows / columns of Pd are 0.
    return acc + dot(pd, do, trans_a=True)

  prog.store(dv_ref, lax.fori_loop(prog.start, prog.stop, body, prog.zero_acc()))


def _dv_delta_kernel(do_ref, pd_ref, v_ref, dv_ref, dpart_ref, *, num_heads, num_kv_heads,
                     seq_q, seq_k, head_dim, block_q, block_k, split):
  """dV and delta's partial row sums: the program keeps its V block on chip, and per step
  also computes ``dPd = dO @ V^T`` and stores ``rowsum(dPd * Pd)`` over its kv block."""
  prog = _DvProgram(do_ref, pd_ref, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    seq_q=seq_q, seq_k=seq_k, head_dim=head_dim, block_q=block_q,
                    block_k=block_k, split=split, v_ref=v_ref)
  v = prog.v

  def body(i, acc):
    bh, q0, q_mask, do, pd = prog.step(i)
    acc = acc + dot(pd, do, trans_a=True)  # dV_j += Pd^T @ dO
    dpd = dot(do, v, trans_b=True)  # dPd = dO @ V_j^T    [block_q, block_k]
    part = jnp.sum(dpd * pd.astype(f32), axis=1)
    tiles.store(dpart_ref.at[bh, prog.j, pl.ds(q0, block_q)], part, q_mask)
    return acc

  prog.store(dv_ref, lax.fori_loop(prog.start, prog.stop, body, prog.zero_acc()))


@functools.partial(jax.jit, static_argnames=["num_heads", "cfg", "interpret", "partials"])
def dv_pass(grad_attn_output, attn_weights_dropped, value_states, *, num_heads, cfg, interpret,
            partials=True):
  """Pass 1: ``(dV [B*KVH, seq_k, D], delta partials [B*H, cdiv(seq_k, block_k), seq_q]
  fp32)``; with ``partials=False``: ``(dV, None)`` (no dPd GEMM, V is not read).

  ``attn_weights_dropped`` is ``[B*H, seq_q, seq_k]``, ``value_states`` ``[B*KVH, seq_k, D]``.
  """
  b, seq_q, h, head_dim = grad_attn_output.shape
  bkvh, seq_k, _ = value_states.shape
  kvh = bkvh // b
  n_kv = pl.cdiv(seq_k, cfg.block_k)
  split = resolve_split(cfg, bkvh * n_kv, (h // kvh) * pl.cdiv(seq_q, cfg.block_q))
  inputs = (grad_attn_output, attn_weights_dropped, value_states)
  dv_struct = _dv_struct(split, value_states, *inputs)
  shape = dict(num_heads=num_heads, num_kv_heads=kvh, seq_q=seq_q, seq_k=seq_k,
               head_dim=head_dim, block_q=cfg.block_q, block_k=cfg.block_k, split=split)
  if partials:
    kernel = functools.partial(_dv_delta_kernel, **shape)
    out_shape = (dv_struct, out_struct((b * h, n_kv, seq_q), f32, *inputs))
    name = "attention_dropout_value_bwd_dv"
  else:
    inputs = inputs[:2]
    kernel = functools.partial(_dv_kernel, **shape)
    out_shape = (dv_struct,)
    name = "attention_dropout_value_bwd_dv_only"
  out = pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(n_kv, bkvh, split),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name=name,
  )(*inputs)
  dpart = out[1] if partials else None
  return _sum_dv_shares(out[0], split, value_states.dtype), dpart


# --------------------------------------------------------------------------------------
# Pass 2: dS = P * (dW - delta).
# --------------------------------------------------------------------------------------
def _ds_inputs(inputs, keep, value_states, delta, scale, dropout: Dropout):
  """``inputs`` (dO, P) plus, in the order :func:`_ds_refs` takes them: keep (unless
  ``dropout`` is "none"), V, ``delta`` (partials or row sums; ``None``: not read) and
  scale (if ``dropout`` is "traced")."""
  inputs = list(inputs)
  if dropout.mode != "none":
    inputs.append(keep)
  inputs.append(value_states)
  if delta is not None:
    inputs.append(delta)
  if dropout.mode == "traced":
    inputs.append(scale)
  return inputs


def _ds_refs(refs, mode, has_delta=True):
  """``(do, p, keep, v, delta, scale, outputs)`` refs of a dS kernel (inputs as
  :func:`_ds_inputs` orders them); ``keep`` is None when ``mode`` is ``"none"``, ``scale``
  unless it is ``"traced"``, ``delta`` unless ``has_delta``; ``outputs`` is the list of
  the remaining (output) refs."""
  refs = list(refs)
  do_ref, p_ref = refs.pop(0), refs.pop(0)
  keep_ref = None if mode == "none" else refs.pop(0)
  v_ref = refs.pop(0)
  delta_ref = refs.pop(0) if has_delta else None
  scale_ref = refs.pop(0) if mode == "traced" else None
  return do_ref, p_ref, keep_ref, v_ref, delta_ref, scale_ref, refs


def _summed_partials(dpart_ref, bh, q0, q_mask, block_q):
  """delta of ``block_q`` rows from pass 1's partials, up to 32 of them per (2D) load:
  ``rowsum(dPd * Pd) = rowsum(dW * P)`` under the precondition."""
  n_part = dpart_ref.shape[1]
  chunk = min(next_power_of_2(n_part), 32)

  def add_chunk(c, acc):
    rows = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    mask = tiles.outer(None if n_part % chunk == 0 else rows < n_part, q_mask)
    part = tiles.load(dpart_ref.at[bh, pl.ds(c * chunk, chunk), pl.ds(q0, block_q)], mask, 0.0)
    return acc + jnp.sum(part, axis=0)

  return tiles.fori_loop(0, pl.cdiv(n_part, chunk), add_chunk, jnp.zeros((block_q,), f32))


class _DsRows:
  """The rows of one program of :func:`_ds_kernel`: ``block_q``
  queries of ``heads`` query heads of one kv group (same batch), looping over all of
  seq_k; each V tile is loaded once for the ``heads`` heads.

  Building it loads the heads' dO tiles and their delta: for rows of one kv tile,
  ``rowsum(dW * P)`` of that tile, exactly as the reference and without the rounding of Pd
  that pass 1's partials carry (which matters most for short rows); else the sum of the
  partials. :meth:`tile` computes and stores one kv tile of dS.

  Refs: do [B, seq_q, H, D], p [B*H, seq_q, seq_k], (keep, same, bool), v [B*KVH, seq_k, D],
  (dpart [B*H, NKV1, seq_q] fp32 unless rows are one tile), (scale [2] fp32 if ``dropout``
  is traced, :func:`_traced_scales`), and the output ds [B*H, seq_q, seq_k].
  """

  def __init__(self, refs, *, num_heads, num_kv_heads, seq_q, seq_k, head_dim, block_q,
               block_k, dropout: Dropout, heads):
    self.dropout, self.block_q, self.block_k, self.seq_k = dropout, block_q, block_k, seq_k
    self.num_kv_tiles = nkv = pl.cdiv(seq_k, block_k)
    (do_ref, self.p_ref, self.keep_ref, self.v_ref, dpart_ref, scale_ref,
     (self.ds_ref,)) = _ds_refs(refs, dropout.mode, nkv > 1)

    groups = num_heads // num_kv_heads
    self.d_pad = tiles.padded_head_dim(head_dim)
    qi = pl.program_id(0)  # q block: fastest grid axis, so programs sharing V run together
    self.bh0 = pl.program_id(1) * heads  # b * H + first head; `heads` divides G
    b = lax.div(self.bh0, i32(num_heads))
    self.h0 = lax.rem(self.bh0, i32(num_heads))
    self.bk = b * num_kv_heads + lax.div(self.h0, i32(groups))
    self.q0 = qi * block_q
    self.heads = range(heads)

    self.d_mask = tiles.dim_mask(self.d_pad, head_dim)
    self.q_mask = tiles.tail_mask(self.q0, block_q, seq_q)
    self.do = [tiles.load(do_ref.at[b, pl.ds(self.q0, block_q), self.h0 + r, tiles.head_dims(self.d_pad)],
                     tiles.outer(self.q_mask, self.d_mask), 0.0) for r in self.heads]
    self.ragged_kv = seq_k % block_k != 0
    if nkv == 1:
      self.delta = [None] * heads  # rowsum(dW * P) in the tile
    else:
      self.delta = [_summed_partials(dpart_ref, self.bh0 + r, self.q0, self.q_mask, block_q)
                    for r in self.heads]
    if dropout.mode == "traced":
      self.keep_scale, self.drop_scale = _traced_scales(scale_ref)

  def kv_mask(self, j, masked):
    """The valid keys of kv tile ``j`` if ``masked`` (it may reach past seq_k), else None."""
    if not masked:
      return None
    return (j * self.block_k + jnp.arange(self.block_k, dtype=jnp.int32)) < self.seq_k

  def load_p_keep(self, j, masked):
    """``[(P, keep) per head]`` of kv tile ``j`` (keep is a constant with no dropout)."""
    mask = tiles.outer(self.q_mask, self.kv_mask(j, masked))
    out = []
    for r in self.heads:
      idx = (self.bh0 + r, pl.ds(self.q0, self.block_q), pl.ds(j * self.block_k, self.block_k))
      p = tiles.load(self.p_ref.at[idx], mask, 0.0)
      keep = (jnp.zeros((), jnp.bool_) if self.dropout.mode == "none"
              else tiles.load(self.keep_ref.at[idx], mask, False))
      out.append((p, keep))
    return tuple(out)

  def tile(self, j, masked):
    """Computes and stores kv tile ``j`` of dS for every head (``masked``: the tile may
    reach past seq_k)."""
    k0 = j * self.block_k
    kv_mask = self.kv_mask(j, masked)
    v = tiles.load(self.v_ref.at[self.bk, pl.ds(k0, self.block_k), tiles.head_dims(self.d_pad)],
              tiles.outer(kv_mask, self.d_mask), 0.0)
    mask = tiles.outer(self.q_mask, kv_mask)
    pk = self.load_p_keep(j, masked)
    for r in self.heads:
      p, keep = pk[r]
      dw = dot(self.do[r], v, trans_b=True)  # dPd, [block_q, block_k] fp32
      if self.dropout.mode == "static":
        dw = jnp.where(keep, dw * self.dropout.scale, 0.0)
      elif self.dropout.mode == "traced":
        dw = dw * jnp.where(keep, self.keep_scale, self.drop_scale)
      p = p.astype(f32)
      row_delta = jnp.sum(dw * p, axis=1) if self.delta[r] is None else self.delta[r]
      ds = p * (dw - row_delta[:, None])
      tiles.store(self.ds_ref.at[self.bh0 + r, pl.ds(self.q0, self.block_q), pl.ds(k0, self.block_k)],
             ds.astype(self.ds_ref.dtype), mask)


def _ds_kernel(*refs, **kwargs):
  """The dS pass on tiles of consecutive rows (:class:`_DsRows`): unmasked kv tiles in the
  steady state, then one masked tail tile if seq_k is ragged (keeps the kv mask out of the
  hot loop)."""
  rows = _DsRows(refs, **kwargs)

  def body(j, carry, masked=False):
    rows.tile(j, masked)
    return carry

  nkv = rows.num_kv_tiles
  if rows.ragged_kv:
    # The tail is a one-trip loop so its start index stays dynamic: a constant start
    # past the end would fail the static slice bounds check of the indexer.
    tiles.fori_loop(0, nkv - 1, body, 0)
    tiles.fori_loop(nkv - 1, nkv, functools.partial(body, masked=True), 0)
  else:
    tiles.fori_loop(0, nkv, body, 0)


def _ds_kernel_phased(*refs, num_heads, num_kv_heads, seq_q, seq_k, head_dim, block_q,
                      block_k, dropout: Dropout, n_part, align):
  """The dS pass for rows of ``seq_k % 8 != 0`` keys, on 16-byte aligned tiles.

  The ``G * seq_q`` rows of one kv group (its G query heads, one after the other in
  memory) share V. One program = one row class of them (``block_q`` rows ``align`` apart,
  see ``pallas_kernels._phase``): they all have the same phase, so one shifted V tile
  serves them all, and a class holds ``G * seq_q / align`` rows, so short heads still fill
  tiles. Column tile ``j`` covers keys ``[j * block_k - phase, (j + 1) * block_k - phase)``;
  every load of P and keep is of 16-byte vectors (``_phase.tile_masks``), and so is every
  store of dS except those of the few elements at each end of a row (a second, scalar
  store in the two edge tiles). (The rows' delta partials, ``align`` rows apart, load as
  scalars.) The steady-state tiles between the edges take no column masks.

  Refs as :class:`_DsRows`, but every array is a flat 1D view (``scale`` stays ``[2]``);
  ``dpart`` holds ``n_part`` partials per row.
  """
  do_ref, p_ref, keep_ref, v_ref, dpart_ref, scale_ref, (ds_ref,) = _ds_refs(refs,
                                                                            dropout.mode)

  groups = num_heads // num_kv_heads
  d_pad = tiles.padded_head_dim(head_dim)
  # u0, u: the tile's first row and its rows, within the group
  cls, u0, u = _phase.class_rows(pl.program_id(0), i32(align), block_q)
  bk = pl.program_id(1)  # b * KVH + kv head
  b = lax.div(bk, i32(num_kv_heads))
  row0 = bk * (groups * seq_q)  # the group's first row among all B * H * seq_q rows
  ph = _phase.phase(row0 + cls, seq_k, i32(align))
  row_ok = u < groups * seq_q
  hg = lax.div(u, i32(seq_q))  # head within the group, per row
  q = lax.rem(u, i32(seq_q))
  bh = bk * groups + hg
  d = jnp.arange(d_pad, dtype=jnp.int32)
  d_mask = None if d_pad == head_dim else d < head_dim
  base = _phase.aligned_base(row0 + u0, seq_k, ph, align)
  do = tiles.load(do_ref.at[((b * seq_q + q) * num_heads + bh - b * num_heads)[:, None] * head_dim
                       + d[None, :]], tiles.outer(row_ok, d_mask), 0.0)

  # delta = rowsum(dPd * Pd) = rowsum(dW * P) under the precondition: pass 1's partials.
  chunk = min(next_power_of_2(n_part), 32)

  def add_chunk(c, acc):
    k = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    offs = (bh[None, :] * n_part + k[:, None]) * seq_q + q[None, :]
    mask = tiles.outer(None if n_part % chunk == 0 else k < n_part, row_ok)
    return acc + jnp.sum(tiles.load(dpart_ref.at[offs], mask, 0.0), axis=0)

  delta = tiles.fori_loop(0, pl.cdiv(n_part, chunk), add_chunk,
                        jnp.zeros((block_q,), f32))

  if dropout.mode == "traced":
    keep_scale, drop_scale = _traced_scales(scale_ref)

  def ds_tile(j, kv, v_mask, mask):
    """``(flat offsets, dS)`` of column tile ``j`` (keys ``kv``)."""
    v = tiles.load(v_ref.at[(bk * seq_k + kv)[:, None] * head_dim + d[None, :]],
              tiles.outer(v_mask, d_mask), 0.0)
    offs = _phase.tile_offsets(base, seq_k, block_q, j * block_k, block_k, align)
    p = tiles.load(p_ref.at[offs], mask, 0.0).astype(f32)
    dw = dot(do, v, trans_b=True)  # dPd, [block_q, block_k] fp32
    if dropout.mode == "static":
      dw = jnp.where(tiles.load(keep_ref.at[offs], mask, False), dw * dropout.scale, 0.0)
    elif dropout.mode == "traced":
      dw = dw * jnp.where(tiles.load(keep_ref.at[offs], mask, False), keep_scale, drop_scale)
    return offs, (p * (dw - delta[:, None])).astype(ds_ref.dtype)

  def body(j, carry, edge=False):
    # V is indexed by hand: tile 0 starts at a negative (masked) key, which a slice clamps.
    kv, valid, load, vector = _phase.tile_masks(j, seq_k, i32(block_k), ph)
    if not edge:  # the tile lies inside the rows: no column masks
      offs, ds = ds_tile(j, kv, None, tiles.outer(row_ok, None))
      tiles.store(ds_ref.at[offs], ds, tiles.outer(row_ok, None))
      return carry
    offs, ds = ds_tile(j, kv, valid, tiles.outer(row_ok, load))
    # 16-byte vectors wholly inside the rows, then the rows' first / last few elements.
    tiles.store(ds_ref.at[offs], ds, tiles.outer(row_ok, vector))
    tiles.store(ds_ref.at[offs], ds, tiles.outer(row_ok, valid & jnp.logical_not(vector)))
    return carry

  # Tiles 0 and nt - 1 reach outside the rows; the ones between take no column masks
  # (rows span at least 2 tiles here: the caller checks).
  nt = _phase.num_tiles(seq_k, i32(block_k), ph)
  tiles.fori_loop(0, 1, functools.partial(body, edge=True), 0)
  tiles.fori_loop(1, nt - 1, body, 0)
  tiles.fori_loop(nt - 1, nt, functools.partial(body, edge=True), 0)


@functools.partial(jax.jit, static_argnames=["num_heads", "dropout", "cfg", "interpret"])
def ds_pass(grad_attn_output, attn_weights, keep, value_states, dpart, scale, *, num_heads,
            dropout: Dropout, cfg: PassConfig, interpret):
  """Pass 2: ``dS [B*H, seq_q, seq_k]`` from dO, P ``[B*H, seq_q, seq_k]``, keep (same;
  unused, may be None, when ``dropout.mode`` is "none"), V ``[B*KVH, seq_k, D]``, delta's
  partials ``dpart`` ``[B*H, n, seq_q]`` fp32 (unused where a row is one kv tile) and the
  traced rate's ``scale`` (:func:`_dropout_args`; unused unless "traced")."""
  b, seq_q, h, head_dim = grad_attn_output.shape
  bkvh, seq_k, _ = value_states.shape
  one_tile = seq_k <= cfg.block_k  # delta in the tile: dpart is not read (may be None)
  inputs = _ds_inputs([grad_attn_output, attn_weights], keep, value_states,
                      None if one_tile else dpart, scale, dropout)
  groups = h // (bkvh // b)
  shape = dict(num_heads=num_heads, num_kv_heads=bkvh // b, seq_q=seq_q, seq_k=seq_k,
               head_dim=head_dim, block_k=cfg.block_k, dropout=dropout)
  if not one_tile and use_phased(cfg, b, h, seq_q, seq_k, head_dim, dpart.size,
                                 value_states.size):
    # Flat views (free reshapes) for the phase-aligned tiles of _ds_kernel_phased.
    flat = [x if x is None or x.ndim < 2 else x.reshape(-1) for x in inputs]
    # Only tile 0 is peeled for the row starts: phase < align <= block_k.
    align, block_q = _phase.resolve(cfg.row_align, groups * seq_q, cfg.block_q, cfg.block_k)
    ds = pallas_call(
        functools.partial(_ds_kernel_phased, **shape, block_q=block_q, n_part=dpart.shape[1],
                          align=align),
        out_shape=out_struct((b * h * seq_q * seq_k,), attn_weights.dtype, *inputs),
        grid=(_phase.num_programs(groups * seq_q, align, block_q), bkvh),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="attention_dropout_value_bwd_ds_aligned",
    )(*flat)
    return ds.reshape(b * h, seq_q, seq_k)
  heads = group_heads(groups, cfg.heads)
  return pallas_call(
      functools.partial(_ds_kernel, **shape, block_q=cfg.block_q, heads=heads),
      out_shape=out_struct((b * h, seq_q, seq_k), attn_weights.dtype, *inputs),
      grid=(pl.cdiv(seq_q, cfg.block_q), b * h // heads),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="attention_dropout_value_bwd_ds",
  )(*inputs)


# --------------------------------------------------------------------------------------
# The two-pass backward (from P, Pd and keep).
# --------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=["p_static", "config", "interpret"])
def _backward(grad_attn_output, attn_weights, attn_weights_dropped, value_states,
              dropout_mask, p_traced, *, p_static, config, interpret):
  b, h, seq_q, seq_k = attn_weights.shape
  kvh, head_dim = value_states.shape[1], value_states.shape[3]
  # Free (bitcast) reshapes to 3D views; dO stays [B, seq_q, H, D].
  p3 = attn_weights.reshape(b * h, seq_q, seq_k)
  pd3 = attn_weights_dropped.reshape(b * h, seq_q, seq_k)
  v3 = value_states.reshape(b * kvh, seq_k, head_dim)
  # Pass 1 makes delta's partials only when the dS pass needs them: not for rows that fit
  # one dS tile (delta in the tile).
  partials = seq_k > config.ds.block_k
  dv, dpart = dv_pass(grad_attn_output, pd3, v3, num_heads=h, cfg=config.dv,
                      interpret=interpret, partials=partials)
  dropout, scale = _dropout_args(p_static, p_traced)
  keep = None if dropout.mode == "none" else dropout_mask.reshape(b * h, seq_q, seq_k)
  ds = ds_pass(grad_attn_output, p3, keep, v3, dpart, scale, num_heads=h, dropout=dropout,
               cfg=config.ds, interpret=interpret)
  return ds.reshape(b, h, seq_q, seq_k), dv.reshape(b, kvh, seq_k, head_dim)


def attention_softmax_dropout_value_backward(
    grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
    attention_dropout, *, config: Config | None = None, block_q=None,
    block_k=None, num_warps=None, num_stages=None, causal=False,
    interpret=False):
  """Backward of ``O = transpose(dropout(P) @ V)`` with GQA, as two Pallas Triton kernels.

  Shapes: dO ``[B, seq_q, H, D]``; P, Pd and keep (bool, True = kept) ``[B, H, seq_q, seq_k]``;
  V ``[B, KVH, seq_k, D]``, ``H % KVH == 0`` (query head ``h`` reads kv head ``h // G``).
  Dtypes: bf16 (the target), fp16 or fp32 (fp32 accumulation, IEEE fp32 dots); returns
  ``(grad_attn_scores [B, H, seq_q, seq_k], grad_value_states [B, KVH, seq_k, D])`` in it.
  The rate p in [0, 1) is a Python float (static; at 0 keep is never read) or a traced
  scalar (outside [0, 1): NaN outputs). ``config`` (:class:`Config`): by default the table
  tuned for the arrays' device kind, else a heuristic; ``block_q``, ``block_k``,
  ``num_warps``, ``num_stages`` override a field of both passes. ``causal``: accepted for
  interface uniformity (a causal P is zero above the diagonal, which the dense math
  handles; no tiles are skipped). ``interpret``: run in the Pallas interpreter.

  Precondition (true of every real forward): ``Pd == round(P * keep / (1 - p))``, so delta
  is ``rowsum(dPd * Pd)``, computed in the pass that reads Pd; rows that fit one kv tile of
  the dS pass take it from dW and P in that tile, exactly as the reference.

  Traffic: 7 B per attention element in bf16 (read P, Pd, keep; write dS), plus
  ``4 / block_k`` B of delta partials. Design: pass 1 (a program per kv block of a (batch,
  kv head)) reads Pd once for ``dV += Pd^T @ dO``, the GQA sum in its accumulator, and
  delta's partials; pass 2 (a program per query tile of ``heads`` heads) recomputes
  ``dPd = dO @ V^T`` and streams P and keep to dS; rows of ``seq_k % 8 != 0`` keys take
  phase-aligned row classes there.
  """
  arrays = (grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask)
  check_can_compile("attention_softmax_dropout_value_backward", interpret, *arrays)
  p = validation.check_attention_softmax_dropout_value(
      grad_attn_output, attn_weights, attn_weights_dropped, value_states, dropout_mask,
      attention_dropout)
  b, h, seq_q, seq_k = attn_weights.shape
  validation.check_causal(causal, seq_q, seq_k, every_row_has_keys=False)
  p_traced = None if p is not None else attention_dropout
  if config is not None and not isinstance(config, Config):
    raise TypeError(f"config: expected a attention_softmax_dropout_value.Config, got {type(config).__name__}")
  if config is None:
    kvh, head_dim = value_states.shape[1], value_states.shape[3]
    config = default_config(b, h, kvh, seq_q, seq_k, head_dim, attn_weights.dtype,
                            _tuning.device_kind_of(*arrays, interpret=interpret))
  config = _tuning.with_overrides(config, block_q=block_q,
                                  block_k=block_k,
                                  num_warps=num_warps, num_stages=num_stages)
  return _backward(grad_attn_output, attn_weights, attn_weights_dropped, value_states,
                   dropout_mask, p_traced, p_static=p, config=config,
                   interpret=interpret)
