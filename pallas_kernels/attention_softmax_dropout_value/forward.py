"""The forward of ``attention_softmax_dropout_value`` in one Pallas Triton kernel, drawing the
dropout mask itself: ``O = transpose(dropout(softmax(scores)) @ V)`` with GQA value heads.

As the jnp forward (``jax_ops.ops.attention_softmax_dropout_value.reference``) computes it::

    P  = softmax(scores) in fp32, rounded to the input dtype     # [B, H, Sq, Skv]
    Pd = (P * keep) * (1 / (1 - p)) in fp32, rounded              # [B, H, Sq, Skv]
    O  = Pd @ V[h // G] in fp32 (input-dtype operands)            # stored [B, Sq, H, D]

with ``keep`` the counter-based mask of :mod:`pallas_kernels._dropout` (the one
``jax_ops.dropout_keep_mask`` draws, bit for bit; one hash per pair of columns) and ``p``
the rate it draws (rounded to a multiple of ``2**-16``).

One program owns ``block_q`` query rows of one (batch, query head). Pass 1 walks the row
block's key tiles and keeps the running row max and the running sum of ``exp(s - max)`` in
fp32. Pass 2 walks them again: ``P = exp(s - m) * (1 / l)`` (``jax.nn.softmax`` as XLA
compiles it), rounded and stored (if asked); the tile's ``keep`` is hashed, ``Pd`` made from
the rounded ``P`` (stored if asked), and ``acc += Pd @ V_tile`` (fp32 accumulation). ``O``
and, if asked, the unrounded fp32 ``O`` are stored straight into the ``[B, Sq, H, D]``
layout. Traffic per attention element in bf16: read the scores twice (the second read
partly from L2), write P (2 B), keep (1 B) and Pd (2 B), each optional.

:func:`attention_softmax_dropout_value_forward_unnormalized` is the variant that normalizes
last, in one pass (online softmax): one read of the scores and one exponential per element.
It writes ``E = exp(s - m_t)`` with ``m_t`` the row's offset at each key tile (its running
max, moved only when passed by more than :data:`SLACK`), instead of P, and a scale per row
and 64 keys, ``exp(m_t - m) / l`` (the Mosaic GPU backward makes
``P = E * scale`` again).

``P`` matches the jnp softmax to within its rounding, not bit for bit: the row sum is
accumulated in another order (online), so the rounded bf16 ``P`` differs by one ulp in about
1e-5 of the elements. ``Pd`` is made from the kernel's own ``P`` exactly as the reference
makes it from its ``P``; ``keep`` is the jnp mask bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton_tiles as tiles
from pallas_kernels import _dropout, _tuning, _util, validation
from pallas_kernels._util import compiler_params, dot, next_power_of_2, out_struct, pallas_call
from pallas_kernels.attention_softmax_dropout_value.config import KERNEL, length_class

_I32 = tiles.i32
_NAME = "attention_softmax_dropout_value_forward"
_F32 = jnp.float32
_U32 = jnp.uint32
_FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32)

# Untuned defaults.
DEFAULT_BLOCK_Q = 32
DEFAULT_BLOCK_K = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3
# Keys per row scale of the forward that normalizes last (the Mosaic GPU backward's
# warpgroup width).
TILE_KEYS = 64
# How far a row's max may pass the offset of its E before the offset moves: E < exp(8).
SLACK = 8.0


def _kernel(seeds_ref, scale_ref, s_ref, v_ref, out_ref, *opt_refs,
            num_heads, num_kv_heads, seq_q, seq_k, head_dim, d_pad, block_q, block_k,
            dropout, store_probs, store_dropped, store_keep, store_f32, late):
  """Refs: seeds [3] uint32 (k0, k1, threshold), scale [1] fp32, scores [B*H, Sq, Skv],
  V [B*KVH, Skv, D]; outputs O [B, Sq, H, D] and, in ``opt_refs``, P [B*H, Sq, Skv] (if
  ``store_probs``), the fp32 O [B, Sq, H, D] (if ``store_f32``), Pd (if ``store_dropped``
  and ``dropout``) and keep (if ``store_keep`` and ``dropout``), both [B*H, Sq, Skv]."""
  opt_refs = list(opt_refs)
  scale_out_ref = opt_refs.pop(0) if late else None
  p_ref = opt_refs.pop(0) if store_probs else None
  out32_ref = opt_refs.pop(0) if store_f32 else None
  pd_ref = opt_refs.pop(0) if dropout and store_dropped else None
  keep_ref = opt_refs.pop(0) if dropout and store_keep else None
  tile_max_ref, row_max_ref = opt_refs if late and store_probs else (None, None)
  groups = num_heads // num_kv_heads
  q0 = pl.program_id(0) * block_q   # row block: the fastest grid axis (programs share V)
  bh = pl.program_id(1)             # b * H + h
  b = lax.div(bh, _I32(num_heads))
  h = lax.rem(bh, _I32(num_heads))
  bk = b * num_kv_heads + lax.div(h, _I32(groups))
  rows = q0 + jnp.arange(block_q, dtype=jnp.int32)
  q_mask = tiles.tail_mask(q0, block_q, seq_q)
  d_mask = tiles.dim_mask(d_pad, head_dim)
  head_dims = tiles.head_dims(d_pad)
  n_k = pl.cdiv(seq_k, block_k)
  ragged_k = seq_k % block_k != 0

  def tile(j):
    """``(cols, key mask, tile mask, index)`` of key tile ``j``."""
    k0 = j * block_k
    cols = k0 + jnp.arange(block_k, dtype=jnp.int32)
    k_mask = cols < seq_k if ragged_k else None
    return cols, k_mask, tiles.outer(q_mask, k_mask), (bh, pl.ds(q0, block_q), tiles.ds(k0, block_k))

  def scores(j):
    """Key tile ``j`` of the scores in fp32; keys past ``seq_k`` are ``-inf`` (padded rows
    load 0: finite, never stored)."""
    cols, k_mask, mask, idx = tile(j)
    s = tiles.load(s_ref.at[idx], mask, 0.0).astype(_F32)
    if k_mask is not None:
      s = jnp.where(k_mask[None, :], s, -jnp.inf)
    return s

  def keep_bits(k0s, k1s, j):
    """The 16 bits ``u`` of key tile ``j``'s elements: block_k is even, so is the tile's
    start, hence one hash per two columns."""
    return _dropout.tile_bits16(k0s, k1s, bh.astype(_U32), rows.astype(_U32)[:, None],
                                (j * block_k).astype(_U32), block_k, seq_k, pairs=True)

  def value_tile(j, k_mask):
    """Key tile ``j`` of V; padded keys and head dims load 0."""
    return tiles.load(v_ref.at[bk, tiles.ds(j * block_k, block_k), head_dims],
                      tiles.outer(k_mask, d_mask), 0.0)

  def store_output(acc):
    """O (and, if asked, the fp32 O) from the fp32 accumulator, into [B, Sq, H, D]."""
    o_idx = (b, pl.ds(q0, block_q), h, head_dims)
    o_mask = tiles.outer(q_mask, d_mask)
    if out32_ref is not None:
      tiles.store(out32_ref.at[o_idx], acc, o_mask)
    tiles.store(out_ref.at[o_idx], acc.astype(out_ref.dtype), o_mask)

  if late:
    return _late_kernel(scores, tile, keep_bits, value_tile, store_output, scale_out_ref,
                        p_ref, seeds_ref, scale_ref, tile_max_ref, row_max_ref,
                        out_dtype=out_ref.dtype, bh=bh, q0=q0, q_mask=q_mask, n_k=n_k,
                        block_q=block_q, d_pad=d_pad, dropout=dropout, block_k=block_k)

  # Pass 1: the row max m and the row sum l of exp(s - m), online.
  def stats(j, carry, s=None):
    m, l = carry
    s = scores(j) if s is None else s
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(s - m_new[:, None]), axis=1)
    return m_new, l

  init = (jnp.full((block_q,), -jnp.inf, _F32), jnp.zeros((block_q,), _F32))
  if n_k == 1:   # one tile holds the rows: loaded once, its statistics the same values
    s0 = scores(_I32(0))
    m, l = stats(_I32(0), init, s0)
  else:
    s0 = None
    m, l = tiles.fori_loop(0, n_k, stats, init)
  # jax.nn.softmax's exp(s - max) / sum, as XLA compiles it on CPU and GPU (its simplifier
  # turns a division by a broadcast into a product with the reciprocal): exp(s - m) * (1 / l).
  inv_l = (1.0 / l)[:, None]
  if dropout:
    k0s, k1s, threshold = seeds_ref[0], seeds_ref[1], seeds_ref[2]
    scale = scale_ref[0]

  # Pass 2: P, keep, Pd, and acc += Pd @ V.
  def value(j, acc, s=None):
    cols, k_mask, mask, idx = tile(j)
    e = jnp.exp((scores(j) if s is None else s) - m[:, None])
    probs = (e * inv_l).astype(out_ref.dtype)
    if p_ref is not None:
      tiles.store(p_ref.at[idx], probs, mask)
    if dropout:
      keep = keep_bits(k0s, k1s, j) >= threshold
      # As the reference's apply_dropout: (P * keep) * scale in fp32, rounded once; an
      # invalid traced rate (a NaN scale) gives NaN.
      dropped = (probs.astype(_F32) * keep.astype(_F32) * scale).astype(out_ref.dtype)
      if pd_ref is not None:
        tiles.store(pd_ref.at[idx], dropped, mask)
      if keep_ref is not None:
        tiles.store(keep_ref.at[idx], keep, mask)
    else:
      dropped = probs
    # Padded keys: P = 0 (exp(-inf)) and V = 0.
    return acc + dot(dropped, value_tile(j, k_mask))

  acc = jnp.zeros((block_q, d_pad), _F32)
  store_output(value(_I32(0), acc, s0) if n_k == 1 else tiles.fori_loop(0, n_k, value, acc))


def _late_kernel(scores, tile, keep_bits, value_tile, store_output, scale_out_ref, e_ref,
                 seeds_ref, scale_ref, tile_max_ref, row_max_ref, *, out_dtype, bh, q0, q_mask,
                 n_k, block_q, d_pad, dropout, block_k):
  """One pass over the key tiles with a running offset ``m`` per row (online softmax):
  ``e = exp(s - m)``, E stored, ``m`` stored once per 64 keys, ``l += rowsum(e)``,
  ``acc += round(e * keep * scale) @ V``; where a tile's row max passes ``m`` by more than
  :data:`SLACK`, ``m`` becomes the running max and ``acc`` and ``l`` are rescaled by
  ``exp(m_old - m)`` first. Then ``O = acc / l``, ``1 / l`` and the last ``m`` stored."""
  if dropout:
    k0s, k1s, threshold = seeds_ref[0], seeds_ref[1], seeds_ref[2]
    scale = scale_ref[0]
  chunks = block_k // TILE_KEYS
  rows = pl.ds(q0, block_q)

  def value(j, carry):
    acc, m, l = carry
    cols, k_mask, mask, idx = tile(j)
    s = scores(j)
    tile_max = jnp.max(s, axis=1)
    grown = jnp.maximum(m, tile_max)
    # A row whose keys so far are all -inf keeps 0 as its max: exp gives 0, never NaN.
    grown = jnp.where(grown == -jnp.inf, 0.0, grown)
    # The offset m moves (acc and l rescaled by exp(m_old - m)) only when some row's max
    # passes it by more than SLACK: E stays under exp(SLACK) and most tiles skip the rescale.
    need = (j == 0) | (jnp.max(tile_max - m) > SLACK)

    def rescale(c):
      alpha = jnp.exp(m - grown)
      return c[0] * alpha[:, None], c[1] * alpha
    acc, l = lax.cond(need, rescale, lambda c: c, (acc, l))
    m_new = jnp.where(need, grown, m)
    e = jnp.exp(s - m_new[:, None])
    l = l + jnp.sum(e, axis=1)
    if e_ref is not None:
      tiles.store(e_ref.at[idx], e.astype(e_ref.dtype), mask)
      for c in range(chunks):
        tiles.store(tile_max_ref.at[bh, j * chunks + c, rows], m_new, q_mask)
    if dropout:
      dropped = jnp.where(keep_bits(k0s, k1s, j) >= threshold, e * scale, 0.0).astype(out_dtype)
    else:
      dropped = e.astype(out_dtype)
    return acc + dot(dropped, value_tile(j, k_mask)), m_new, l

  init = (jnp.zeros((block_q, d_pad), _F32), jnp.full((block_q,), -jnp.inf, _F32),
          jnp.zeros((block_q,), _F32))
  acc, m, l = value(_I32(0), init) if n_k == 1 else tiles.fori_loop(0, n_k, value, init)
  inv_l = 1.0 / l
  tiles.store(scale_out_ref.at[bh, rows], inv_l, q_mask)
  if e_ref is not None:
    tiles.store(row_max_ref.at[bh, rows], m, q_mask)
  store_output(acc * inv_l[:, None])


def takes(b, h, kvh, seq_q, seq_k, head_dim) -> bool:
  """Whether the kernel takes a problem of these sizes: its int32 offsets reach every element
  of the scores, V and O (fewer than ``2**31`` each)."""
  return max(b * h * seq_q * seq_k, b * kvh * seq_k * head_dim, b * seq_q * h * head_dim) < 2**31


def forward_config(seq_q: int, seq_k: int, head_dim: int, dtype,
                   device_kind: str | None = None) -> _tuning.TritonPassConfig:
  """The launch for rows of ``seq_k`` keys on ``device_kind``: the ``"fwd"`` entry of their
  length class in the device's ``attention_softmax_dropout_value`` table (16-bit inputs with
  ``head_dim <= 128``, the problems the tuner times), its tiles capped at the padded lengths;
  else the defaults (:func:`default_blocks`, :data:`DEFAULT_NUM_WARPS` warps,
  :data:`DEFAULT_NUM_STAGES` stages; also for ``device_kind`` ``None``)."""
  fields = _tuning.forward_entry(KERNEL, device_kind, length_class(seq_k), dtype, head_dim)
  if fields is not None:
    return _tuning.TritonPassConfig(**fields).capped(seq_q, seq_k)
  return _tuning.TritonPassConfig(*default_blocks(seq_q, seq_k), DEFAULT_NUM_WARPS,
                                  DEFAULT_NUM_STAGES)


def default_blocks(seq_q: int, seq_k: int) -> tuple[int, int]:
  """``(block_q, block_k)``: the untuned defaults capped at the padded lengths (>= 16)."""
  return (min(DEFAULT_BLOCK_Q, max(16, next_power_of_2(seq_q))),
          min(DEFAULT_BLOCK_K, max(16, next_power_of_2(seq_k))))


@functools.partial(jax.jit, static_argnames=("dropout", "store_probs", "store_dropped",
                                             "store_keep", "store_f32", "late", "block_q",
                                             "block_k", "num_warps", "num_stages", "interpret"))
def _call(scores, value_states, seeds, scale, *, dropout, store_probs, store_dropped,
          store_keep, store_f32, block_q, block_k, num_warps, num_stages, interpret,
          late=False):
  b, h, seq_q, seq_k = scores.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  kernel = functools.partial(
      _kernel, num_heads=h, num_kv_heads=kvh, seq_q=seq_q, seq_k=seq_k, head_dim=d,
      d_pad=tiles.padded_head_dim(d), block_q=block_q, block_k=block_k, dropout=dropout,
      store_probs=store_probs, store_dropped=store_dropped, store_keep=store_keep,
      store_f32=store_f32, late=late)
  flat = (b * h, seq_q, seq_k)
  args = (seeds, scale, scores.reshape(flat), value_states.reshape(b * kvh, seq_k, d))
  o_shape = (b, seq_q, h, d)
  out_shape = [out_struct(o_shape, scores.dtype, *args)]
  if late:
    out_shape.append(out_struct((b * h, seq_q), _F32, *args))
  if store_probs:
    out_shape.append(out_struct(flat, exp_dtype(scores.dtype) if late else scores.dtype, *args))
  if store_f32:
    out_shape.append(out_struct(o_shape, _F32, *args))
  pd_out, keep_out = dropout and store_dropped, dropout and store_keep
  if pd_out:
    out_shape.append(out_struct(flat, scores.dtype, *args))
  if keep_out:
    out_shape.append(out_struct(flat, jnp.bool_, *args))
  if late and store_probs:   # the offsets, per 64 keys of each key tile
    n_tiles = pl.cdiv(seq_k, block_k) * (block_k // TILE_KEYS)
    out_shape.append(out_struct((b * h, n_tiles, seq_q), _F32, *args))
    out_shape.append(out_struct((b * h, seq_q), _F32, *args))
  out, *rest = pallas_call(
      kernel,
      out_shape=tuple(out_shape),
      grid=(pl.cdiv(seq_q, block_q), b * h),
      compiler_params=compiler_params(num_warps, num_stages),
      interpret=interpret,
      name=_NAME,
  )(*args)
  shape = scores.shape
  if late:
    row_scale = rest.pop(0).reshape(shape[:3])
    probs = rest.pop(0).reshape(shape) if store_probs else None
    out32 = rest.pop(0) if store_f32 else None
    if store_probs:   # P = E * exp(m_tile - m) / l, per 64 keys
      tile_max, row_max = rest
      n_t = pl.cdiv(seq_k, TILE_KEYS)
      row_scale = (jnp.exp(tile_max[:, :n_t] - row_max[:, None])
                   * row_scale.reshape(b * h, 1, seq_q)).reshape(b, h, n_t, seq_q)
    return out, probs, row_scale, out32
  probs = rest.pop(0).reshape(shape) if store_probs else None
  out32 = rest.pop(0) if store_f32 else None
  dropped = rest.pop(0).reshape(shape) if pd_out else None
  keep = rest.pop(0).reshape(shape) if keep_out else None
  return out, probs, dropped, keep, out32


def attention_softmax_dropout_value_forward(scores, value_states, dropout_rate, dropout_rng=None,
                                            *, store_probs: bool = True,
                                            store_dropped: bool = False,
                                            store_keep: bool = True, store_f32: bool = True,
                                            block_q=None, block_k=None, num_warps=None, num_stages=None,
                                            interpret=False):
  """``(O, P, Pd, keep, O_f32)`` of ``O = transpose(dropout(softmax(scores)) @ V)``.

  Args:
    scores: ``[B, H, Sq, Skv]`` float (bf16 in the usual case; fp16, fp32).
    value_states: ``[B, KVH, Skv, D]``, the scores' dtype, ``H % KVH == 0``: query head
      ``h`` reads value head ``h // (H // KVH)``. Any ``D`` (padded to a power of two).
    dropout_rate: in [0, 1), a Python float or a traced scalar; rounded to a multiple of
      ``2**-16`` (``pallas_kernels._dropout.effective_rate``), which scales the kept values.
      A traced rate outside [0, 1) gives NaN outputs.
    dropout_rng: a PRNG key (needed for a rate that may be > 0); the mask is
      ``jax_ops.dropout_keep_mask(dropout_rng, dropout_rate, scores.shape)``.
    store_probs: whether the kernel writes ``P`` (a Python bool; ``False``, for a call that
      needs only ``O``: ``None`` is returned for it).
    store_dropped: whether ``Pd`` is returned (a Python bool; the kernel writes it only
      with dropout: for a concrete rate of 0 it is ``P`` itself).
    store_keep: whether the kernel writes ``keep`` (a Python bool).
    store_f32: whether the kernel writes ``O_f32`` (a Python bool; ``[B, Sq, H, D]`` fp32 is
      ``2 * D / Skv`` of the bf16 scores' bytes: half of them at ``Skv = 512``).
    block_q, block_k: tiles (powers of two >= 16), and
    num_warps, num_stages: Triton launch parameters; each left ``None`` takes
      :func:`forward_config`'s (the device's tuned table, else the defaults).
    interpret: run the kernel in the Pallas interpreter (any backend).

  Returns:
    ``O`` ``[B, Sq, H, D]`` in the scores' dtype; ``P`` ``[B, H, Sq, Skv]`` in the scores'
    dtype, or ``None`` with ``store_probs=False``; ``Pd`` likewise, or ``None`` unless
    ``store_dropped``; ``keep`` ``[B, H, Sq, Skv]`` bool, or ``None`` for a concrete rate of
    0 or with ``store_keep=False``; ``O_f32`` ``[B, Sq, H, D]`` fp32, ``O`` before its rounding, or
    ``None`` with ``store_f32=False``.
  """
  for name, flag in (("store_probs", store_probs), ("store_dropped", store_dropped),
                     ("store_keep", store_keep), ("store_f32", store_f32)):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(f"{name}: expected a Python bool, got {type(flag).__name__}")
  dropout, launch = _launch_args(scores, value_states, dropout_rate, dropout_rng, block_q,
                                 block_k, num_warps, num_stages, interpret)
  # Without dropout the kernel stores neither Pd nor keep: one compiled kernel for the flags
  # (P, which is Pd then, is written for a Pd asked for).
  out, probs, dropped, keep, out32 = _call(
      scores, value_states, *launch[:2], dropout=dropout,
      store_probs=bool(store_probs) or (bool(store_dropped) and not dropout),
      store_dropped=dropout and bool(store_dropped), store_keep=dropout and bool(store_keep),
      store_f32=bool(store_f32), **launch[2])
  if store_dropped and not dropout:
    dropped = probs
  return out, probs if store_probs else None, dropped, keep, out32


def exp_dtype(dtype):
  """The dtype of the unnormalized forward's ``E`` (values in [0, 1]): fp16 for 16-bit
  scores (11 significant bits, against bf16's 8: ``E * row_scale`` rounds P about as finely
  as the normalized forward's one rounding), fp32 for fp32 scores."""
  return jnp.float32 if jnp.dtype(dtype) == jnp.float32 else jnp.float16


def attention_softmax_dropout_value_forward_unnormalized(
    scores, value_states, dropout_rate, dropout_rng=None, *, store_exp: bool = True,
    store_f32: bool = True, block_q=None, block_k=None, num_warps=None, num_stages=None,
    interpret=False):
  """``(O, E, row_scale, O_f32)``: the forward with its softmax left unnormalized, in one
  pass over the keys.

  ``E = round(exp(s - m_t))`` ``[B, H, Sq, Skv]`` (fp16 for 16-bit scores, fp32 for fp32:
  :func:`exp_dtype`; values under fp16's ``2**-24`` are 0, values at most ``exp(SLACK)``),
  with ``m_t`` the row's offset at the key tile holding the element, and
  ``row_scale = exp(m_t - m) / l`` ``[B, H, ceil(Skv / 64), Sq]`` fp32 per row and 64 keys
  (``m`` the last offset, ``l = rowsum(exp(s - m))``), so that ``P = E * row_scale`` up to
  E's rounding (:func:`probs_from_exp`). The kernel keeps the offset, ``l`` and ``acc``
  online (the offset moves to the running max, and ``l`` and ``acc`` are rescaled, only
  when a row's max passes it by more than :data:`SLACK`), adds ``round(e * keep * scale) @ V``
  per tile and ends with ``O = acc / l`` (O is the dropped softmax times V up to Pd's
  rounding, which happens before the normalization here and after it in
  :func:`attention_softmax_dropout_value_forward`). Key tiles (``block_k``) of 64 keys or a
  multiple. ``store_exp``/``store_f32`` (Python bools): whether E and its scales / ``O_f32``
  are written (else ``None``). The other arguments are
  :func:`attention_softmax_dropout_value_forward`'s; ``keep`` is drawn, never stored.
  """
  for name, flag in (("store_exp", store_exp), ("store_f32", store_f32)):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(f"{name}: expected a Python bool, got {type(flag).__name__}")
  dropout, launch = _launch_args(scores, value_states, dropout_rate, dropout_rng, block_q,
                                 block_k, num_warps, num_stages, interpret,
                                 min_block_k=TILE_KEYS)
  return _call(scores, value_states, *launch[:2], dropout=dropout,
               store_probs=bool(store_exp), store_dropped=False, store_keep=False,
               store_f32=bool(store_f32), late=True, **launch[2])


def probs_from_exp(exp, row_scale):
  """``P = E * row_scale[..., k // 64, q]`` in fp32, ``[B, H, Sq, Skv]``, from the outputs
  of :func:`attention_softmax_dropout_value_forward_unnormalized`."""
  seq_k = exp.shape[-1]
  per_key = jnp.repeat(jnp.swapaxes(row_scale, -1, -2), TILE_KEYS, axis=-1)[..., :seq_k]
  return exp.astype(_F32) * per_key


def _launch_args(scores, value_states, dropout_rate, dropout_rng, block_q, block_k, num_warps,
                 num_stages, interpret, min_block_k=16):
  """Checks a forward call; ``(dropout, (seeds, scale, launch keywords))``. Key tiles of
  ``min_block_k`` keys or more (a default below it is raised to it)."""
  _util.check_can_compile(_NAME, interpret, scores, value_states)
  validation.check_scores_and_value(scores, value_states, dtypes=_FLOATS)
  b, h, seq_q, seq_k = scores.shape
  if not takes(b, h, value_states.shape[1], seq_q, seq_k, value_states.shape[3]):
    raise ValueError(f"scores: at most 2**31 - 1 elements per array (int32 offsets), got "
                     f"scores {list(scores.shape)}, value_states {list(value_states.shape)}")
  # The reference's scale, 1 / (1 - p) in fp32, of the rate drawn; NaN for an invalid
  # traced rate.
  dropout, seeds, scale = _dropout.kernel_args(dropout_rate, dropout_rng)
  base = forward_config(seq_q, seq_k, value_states.shape[3], scores.dtype,
                        _tuning.device_kind_of(scores, value_states, interpret=interpret))
  # Validates the launch parameters (ValueError naming the field).
  cfg = _tuning.TritonPassConfig(
      block_q=base.block_q if block_q is None else block_q,
      block_k=max(base.block_k, min_block_k) if block_k is None else block_k,
      num_warps=base.num_warps if num_warps is None else num_warps,
      num_stages=base.num_stages if num_stages is None else num_stages)
  if cfg.block_k < min_block_k:
    raise ValueError(f"block_k: at least {min_block_k} keys for this forward, got {cfg.block_k}")
  return dropout, (seeds, scale, dict(
      block_q=cfg.block_q, block_k=cfg.block_k,
      num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=bool(interpret)))
