"""Pallas Triton kernel: the backward of ``O = transpose(dropout(softmax) @ V)`` with GQA
given ``delta = rowsum(dO * O)`` instead of Pd, in one kernel (the math: :mod:`.pallas_triton`).

An op that keeps its forward's fp32 output O has delta for ``O(B * H * seq_q * D)`` work
(:func:`delta_from_output`); the kernel then reads P and keep and writes dS (5 B per
attention element in bf16) and computes dV on the way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton_tiles as tiles
from pallas_kernels import validation
from pallas_kernels._util import (Dropout, check_can_compile, compiler_params, dot, out_struct,
                                  pallas_call)
from pallas_kernels.attention_softmax_dropout_value.config import (
    PassConfig, default_from_delta_config, resolve_split)
from pallas_kernels.attention_softmax_dropout_value.pallas_triton import (
    _dropout_args, _ds_inputs, _ds_refs, _dv_struct, _kv_block_ids, _share_range,
    _store_dv, _sum_dv_shares, _traced_scales)

f32 = jnp.float32
i32 = np.int32  # index constants: int32 under x64 too (the kernels index with int32)


def delta_from_output(grad_attn_output, attn_output_f32):
  """``delta = rowsum(dO * O) = rowsum(dPd * Pd)``, ``[B, H, seq_q]`` fp32, from dO
  ``[B, seq_q, H, D]`` and the forward's fp32 output ``O = Pd @ V`` (before its rounding):
  the ``delta`` of :func:`attention_softmax_dropout_value_backward_from_delta`."""
  return jnp.einsum("bqhd,bqhd->bhq", grad_attn_output.astype(f32), attn_output_f32,
                    precision=lax.Precision.HIGHEST)


# --------------------------------------------------------------------------------------
# From delta: one pass for dS and dV (the op's backward, which has delta from its output).
# --------------------------------------------------------------------------------------
def _group_rows_do(do_ref, b, kvh, u, row_mask, d, d_mask, *, seq_q, num_heads, groups,
                   head_dim):
  """dO of rows ``u`` of a kv group's ``G * seq_q`` rows (head ``u // seq_q``, query
  ``u % seq_q``), gathered from the flat ``[B, seq_q, H, D]`` array: ``[len(u), d_pad]``."""
  h = kvh * groups + lax.div(u, i32(seq_q))
  q = lax.rem(u, i32(seq_q))
  offs = (((b * seq_q + q) * num_heads + h) * head_dim)[:, None] + d[None, :]
  return tiles.load(do_ref.at[offs], tiles.outer(row_mask, d_mask), 0.0)


def _ds_dv_kernel(*refs, num_heads, num_kv_heads, seq_q, seq_k, head_dim, block_q, block_k,
                  dropout: Dropout, split, exact_delta):
  """dS and dV of one ``block_k`` keys of one kv group, from P and keep alone.

  One program = one kv block of one (batch, kv head) and one of ``split`` shares of the
  loop over the group's ``G * seq_q`` rows (its G heads one after the other, so short heads
  still fill tiles). It keeps V's block and an fp32 dV accumulator on chip; per tile of
  rows it reads P and keep, recomputes ``dPd = dO @ V^T``, writes
  ``dS = P * (dW - delta)`` and rebuilds ``Pd = round(P * keep / (1 - p))`` (the
  precondition) for ``dV += Pd^T @ dO``. ``exact_delta`` (a row is one kv block): delta
  is ``rowsum(dW * P)`` of the tile, exactly as the reference, and no delta is read.

  Refs: do flat ``[B*seq_q*H*D]``, p ``[B*KVH, G*seq_q, seq_k]``, (keep, same), v
  ``[B*KVH, seq_k, D]``, (delta ``[B*KVH, G*seq_q]`` fp32 unless ``exact_delta``), (scale
  ``[2]`` fp32 if ``dropout`` is traced, :func:`_traced_scales`); outputs ds (as p), dv
  ``[B*KVH, seq_k, D]`` (``split > 1``: ``[split, B*KVH, seq_k, D]`` fp32 partial sums).
  """
  mode = dropout.mode
  do_ref, p_ref, keep_ref, v_ref, delta_ref, scale_ref, (ds_ref, dv_ref) = _ds_refs(
      refs, mode, not exact_delta)

  groups = num_heads // num_kv_heads
  rows = groups * seq_q
  d_pad = tiles.padded_head_dim(head_dim)
  _, bk, share, b, kvh, k0 = _kv_block_ids(num_kv_heads, block_k)
  d = jnp.arange(d_pad, dtype=jnp.int32)
  d_mask = None if d_pad == head_dim else d < head_dim
  kv_mask = tiles.tail_mask(k0, block_k, seq_k)
  v_tile_mask = tiles.outer(kv_mask, d_mask)
  v = tiles.load(v_ref.at[bk, pl.ds(k0, block_k), tiles.head_dims(d_pad)], v_tile_mask, 0.0)
  if mode == "traced":
    keep_scale, drop_scale = _traced_scales(scale_ref)

  def body(i, acc, masked=False):
    r0 = i * block_q
    u = r0 + jnp.arange(block_q, dtype=jnp.int32)
    row_mask = u < rows if masked else None
    mask = tiles.outer(row_mask, kv_mask)
    do = _group_rows_do(do_ref, b, kvh, u, row_mask, d, d_mask, seq_q=seq_q,
                        num_heads=num_heads, groups=groups, head_dim=head_dim)
    idx = (bk, pl.ds(r0, block_q), pl.ds(k0, block_k))
    p = tiles.load(p_ref.at[idx], mask, 0.0)
    pf = p.astype(f32)
    dpd = dot(do, v, trans_b=True)  # [block_q, block_k] fp32
    if mode == "none":
      dw, pd = dpd, p
    else:
      keep = tiles.load(keep_ref.at[idx], mask, False)
      if mode == "static":
        dw = jnp.where(keep, dpd * dropout.scale, 0.0)
        pd = jnp.where(keep, pf * dropout.scale, 0.0).astype(p.dtype)
      else:
        s = jnp.where(keep, keep_scale, drop_scale)
        dw = dpd * s
        pd = (pf * s).astype(p.dtype)
    if exact_delta:
      delta = jnp.sum(dw * pf, axis=1)
    else:
      delta = tiles.load(delta_ref.at[bk, pl.ds(r0, block_q)], row_mask, 0.0)
    tiles.store(ds_ref.at[idx], (pf * (dw - delta[:, None])).astype(ds_ref.dtype), mask)
    # dV_j^T += dO^T @ Pd: Pd, made in registers, is the GEMM's B operand as it is
    # (as the A operand of Pd^T @ dO it would need a transpose).
    return acc + dot(do, pd, trans_a=True)

  n_tiles = pl.cdiv(rows, block_q)
  start, stop = _share_range(share, n_tiles, split)
  acc = jnp.zeros((d_pad, block_k), f32)  # dV_j^T
  if rows % block_q:
    # Only the last tile of rows is ragged: the share holding it runs it masked.
    full = n_tiles - 1
    acc = lax.fori_loop(start, jnp.minimum(stop, full), body, acc)
    acc = lax.fori_loop(jnp.maximum(start, full), stop, functools.partial(body, masked=True),
                        acc)
  else:
    acc = lax.fori_loop(start, stop, body, acc)
  acc = acc.T
  _store_dv(dv_ref, acc, split, share, bk, k0, block_k, d_pad, v_tile_mask)


@functools.partial(jax.jit, static_argnames=["num_heads", "dropout", "cfg", "interpret"])
def ds_dv_pass(grad_attn_output, attn_weights, keep, value_states, delta, scale, *, num_heads,
               dropout: Dropout, cfg: PassConfig, interpret):
  """``(dS [B*KVH, G*seq_q, seq_k], dV [B*KVH, seq_k, D])`` from P, keep and delta, one kernel.

  ``attn_weights`` and ``keep`` are ``[B*KVH, G*seq_q, seq_k]`` (a kv group's heads one
  after the other); ``delta`` is ``[B*KVH, G*seq_q]`` fp32, unused (may be None) where
  ``cfg.block_k >= seq_k``; ``keep`` / ``scale`` as in :func:`ds_pass`.
  """
  b, seq_q, h, head_dim = grad_attn_output.shape
  bkvh, rows, seq_k = attn_weights.shape
  kvh = bkvh // b
  exact_delta = seq_k <= cfg.block_k
  n_kv = pl.cdiv(seq_k, cfg.block_k)
  split = resolve_split(cfg, bkvh * n_kv, pl.cdiv(rows, cfg.block_q))
  inputs = _ds_inputs([grad_attn_output.reshape(-1), attn_weights], keep, value_states,
                      None if exact_delta else delta, scale, dropout)
  ds, dv = pallas_call(
      functools.partial(_ds_dv_kernel, num_heads=num_heads, num_kv_heads=kvh, seq_q=seq_q,
                        seq_k=seq_k, head_dim=head_dim, block_q=cfg.block_q,
                        block_k=cfg.block_k, dropout=dropout, split=split,
                        exact_delta=exact_delta),
      out_shape=(out_struct(attn_weights.shape, attn_weights.dtype, *inputs),
                 _dv_struct(split, value_states, *inputs)),
      grid=(n_kv, bkvh, split),
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="attention_dropout_value_bwd_ds_dv",
  )(*inputs)
  return ds, _sum_dv_shares(dv, split, value_states.dtype)


@functools.partial(jax.jit, static_argnames=["p_static", "cfg", "interpret"])
def _backward_from_delta(grad_attn_output, attn_weights, value_states, dropout_mask, delta,
                         p_traced, *, p_static, cfg, interpret):
  b, h, seq_q, seq_k = attn_weights.shape
  kvh, head_dim = value_states.shape[1], value_states.shape[3]
  rows = (b * kvh, (h // kvh) * seq_q, seq_k)  # free reshapes: a kv group's rows, head by head
  dropout, scale = _dropout_args(p_static, p_traced)
  keep = None if dropout.mode == "none" else dropout_mask.reshape(rows)
  ds, dv = ds_dv_pass(grad_attn_output, attn_weights.reshape(rows), keep,
                      value_states.reshape(b * kvh, seq_k, head_dim), delta.reshape(rows[:2]),
                      scale, num_heads=h, dropout=dropout, cfg=cfg, interpret=interpret)
  return ds.reshape(b, h, seq_q, seq_k), dv.reshape(b, kvh, seq_k, head_dim)


def attention_softmax_dropout_value_backward_from_delta(
    grad_attn_output: jax.typing.ArrayLike, attn_weights: jax.typing.ArrayLike,
    value_states: jax.typing.ArrayLike, dropout_mask: jax.typing.ArrayLike | None,
    attention_dropout: float | jax.typing.ArrayLike, delta: jax.typing.ArrayLike, *,
    config: PassConfig | None = None, causal: bool = False,
    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """The backward of :func:`attention_softmax_dropout_value_backward`, given ``delta``
  instead of Pd: one kernel that reads P and keep, writes dS and computes dV on the way.

  Inputs as that entry point's, without Pd (``dropout_mask`` may be None when the rate is
  a concrete 0), plus ``delta`` ``[B, H, seq_q]`` fp32, ``rowsum(dPd * Pd)`` of each row:
  an op that keeps its forward's fp32 output O has it for ``O(B*H*seq_q*D)`` work
  (:func:`delta_from_output`). Rows that fit one kv tile (``seq_k <= config.block_k``) do not
  read it: their delta is ``rowsum(dW * P)`` of the tile, exactly as the reference.
  ``config``: a :class:`PassConfig` (its ``split`` as in the dV pass), default
  :func:`default_from_delta_config`. ``causal``: accepted for interface uniformity (the
  dense math handles a causal P; no tiles are skipped). Returns
  ``(grad_attn_scores [B, H, seq_q, seq_k], grad_value_states [B, KVH, seq_k, D])``.

  Precondition: ``Pd == round(P * keep * (1 / (1 - p)))`` with ``1 / (1 - p)`` in fp32, the
  forward's Pd, which the kernel rebuilds for dV instead of reading it (a Pd off by an ulp
  in many elements would put dV outside the spec's tolerance).

  Traffic: 5 B per attention element in bf16 (read P and keep, write dS), against 7 B for
  the two passes, but two GEMMs per element. Design: one program per ``block_k`` keys of a
  (batch, kv head), looping over the group's ``G * seq_q`` rows: ``dPd = dO @ V^T``,
  ``dS = P * (dW - delta)``, ``dV^T += dO^T @ Pd``. Its column tiles load rows of
  ``seq_k % 8 != 0`` keys element by element.
  """
  arrays = validation.as_jax(grad_attn_output, attn_weights, value_states, dropout_mask, delta)
  grad_attn_output, attn_weights, value_states, dropout_mask, delta = arrays
  check_can_compile("attention_softmax_dropout_value_backward_from_delta", interpret, *arrays)
  p = validation.check_attention_softmax_dropout_value(
      grad_attn_output, attn_weights, None, value_states, dropout_mask, attention_dropout,
      takes_pd=False)
  b, h, seq_q, seq_k = attn_weights.shape
  validation.check_causal(causal, seq_q, seq_k, every_row_has_keys=False)
  validation.check_array("delta", delta, ("B", "H", "Sq"), (b, h, seq_q), dtypes=(f32,))
  if grad_attn_output.size >= 2**31:
    raise ValueError(f"grad_attn_output: at most 2**31 - 1 elements (int32 offsets), got "
                     f"shape {grad_attn_output.shape}")
  if config is not None and not isinstance(config, PassConfig):
    raise TypeError(f"config: expected a PassConfig, got {type(config).__name__}")
  cfg = config or default_from_delta_config(seq_q, seq_k, value_states.shape[3],
                                            attn_weights.dtype)
  return _backward_from_delta(grad_attn_output, attn_weights, value_states, dropout_mask,
                              delta, None if p is not None else attention_dropout,
                              p_static=p, cfg=cfg, interpret=interpret)
