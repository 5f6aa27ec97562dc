"""The forward of op A in one Pallas Triton kernel, drawing the dropout mask itself:
``O = transpose(dropout(softmax(scores)) @ V)`` with GQA value heads.

As the jnp forward (``jax_ops.ops.attention_softmax_dropout_value.reference.attention_softmax_dropout_value_forward``)
computes it::

    P  = softmax(scores) in fp32, rounded to the input dtype     # [B, H, Sq, Skv]
    Pd = (P * keep) * (1 / (1 - p)) in fp32, rounded              # [B, H, Sq, Skv]
    O  = Pd @ V[h // G] in fp32 (input-dtype operands)            # stored [B, Sq, H, D]

with ``keep`` the counter-based mask of :mod:`pallas_kernels._dropout` (the one
``jax_ops.dropout_keep_mask`` draws, bit for bit) and ``p`` the rate it draws (rounded to a
multiple of ``2**-16``).

One program owns ``block_q`` query rows of one (batch, query head). Pass 1 walks the row
block's key tiles (``block_k`` keys each) and keeps the running row max and the running sum
of ``exp(s - max)`` in fp32 (rescaled when the max grows). Pass 2 walks them again: ``P =
exp(s - m) * (1 / l)`` (``jax.nn.softmax``'s ``exp(s - max) / sum`` as XLA compiles it, on
CPU and GPU: its simplifier makes a division by a broadcast a product with the reciprocal),
rounded and stored (if asked); the tile's ``keep`` is hashed, ``Pd`` made from the rounded
``P`` (stored if asked), and ``acc += Pd @ V_tile`` (fp32 accumulation, tensor cores for
bf16 / fp16). ``O`` (input dtype) and, if asked, the unrounded fp32 ``O`` are stored straight
into the ``[B, Sq, H, D]`` layout (no transpose pass). Padded rows, keys and head-dim columns
are masked (``-inf`` for the max, 0 for ``P`` and ``V``). Traffic per attention element in
bf16: read the scores twice (the second read partly from L2), write P (2 B, optional), keep
(1 B, optional) and Pd (2 B, optional).

``P`` matches the jnp softmax to within its rounding, not bit for bit: the row sum is
accumulated in another order (and online, rescaled), so the fp32 ``P`` differs by a few fp32
ulps (up to 6 seen) and the rounded bf16 ``P`` by one ulp in about 1e-5 of the elements (those
whose fp32 value lies next to a rounding boundary; H200, random normal scores: 99.9986% to
99.9991% equal, never more than 1 ulp; the same in the interpreter). ``Pd`` is made from the
kernel's own ``P`` exactly as the reference makes it from its ``P`` (so it can be 2 ulps from
the reference's where ``P`` is 1 off); ``keep`` is the jnp mask bit for bit.

The defaults (:func:`default_blocks`; block_q 32, block_k 64, 4 warps, 3 stages, the tiles
capped at the padded sequence lengths, at least 16) are not tuned: the best of a dozen
configs at one shape (B=4, S=1024, H=80, KVH=8, D=128, bf16; block_q 64 was 1.3x slower).
Measured on an H200 (``benchmarks/a_forward.py``, dropout 0.1, those heads, S = 512 to
2048): 1.21-1.34x faster than the jnp forward writing ``(O, P, keep, O_f32)``, 0.83-0.94x
when it also writes Pd (the jnp forward writes all five). The dropout hash cost about a
fifth of the kernel's time (rate 0: 944 us, 0.1: 1196 us there, 2 stages); hashing once per
pair of columns (``pair_hash``, the default: both 16-bit halves of each hash, interleaved by
a join and a reshape) made the kernel 11.4-11.7% faster at the ``(O, P, Pd)`` outputs
(``benchmarks/results/runs/a_forward_pairs_17ee78a.log``: 1.38-1.58x the jnp forward).

Writing ``(O, P, Pd)`` alone (no keep, no fp32 O), one hash per element: 1.22-1.40x faster
than the jnp forward (``benchmarks/results/runs/a_forward_8ad47f9.log``); writing keep as a
third ``[B, H, Sq, Skv]`` output costs about 45% more time, more than its bytes.

Op A's Triton backend runs it on rows of >= 512 keys (``jax_ops.ops.attention_softmax_dropout_value``'s residual
policy ``"fused_output"``: O, P, keep and O_f32); its Mosaic GPU backend runs it writing O, P
and O_f32 on rows of more than 128 keys (``"fused_output"`` too: its backward draws keep
again from the key) and O, P and Pd on rows of 128 keys (``"fused_inputs"``).
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

_I32 = tiles.i32
_NAME = "attention_softmax_dropout_value_forward"
_F32 = jnp.float32
_U32 = jnp.uint32
_FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32)

# Untuned (see the module docstring).
DEFAULT_BLOCK_Q = 32
DEFAULT_BLOCK_K = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3
PAIR_HASH = True   # one hash per pair of columns: measured 11-12% faster (H200)


def _kernel(seeds_ref, scale_ref, s_ref, v_ref, out_ref, *opt_refs,
            num_heads, num_kv_heads, seq_q, seq_k, head_dim, d_pad, block_q, block_k,
            dropout, store_probs, store_dropped, store_keep, store_f32, pair_hash,
            store_bits=False):
  """Refs: seeds [3] uint32 (k0, k1, threshold), scale [1] fp32, scores [B*H, Sq, Skv],
  V [B*KVH, Skv, D]; outputs O [B, Sq, H, D] and, in ``opt_refs``, P [B*H, Sq, Skv] (if
  ``store_probs``), the fp32 O [B, Sq, H, D] (if ``store_f32``), Pd (if ``store_dropped``
  and ``dropout``) and keep (if ``store_keep`` and ``dropout``), both [B*H, Sq, Skv], and
  keep as bits (if ``store_bits`` and ``dropout``), [B*KVH, Skv / 32, G*Sq] int32."""
  opt_refs = list(opt_refs)
  p_ref = opt_refs.pop(0) if store_probs else None
  out32_ref = opt_refs.pop(0) if store_f32 else None
  pd_ref = opt_refs.pop(0) if dropout and store_dropped else None
  keep_ref = opt_refs.pop(0) if dropout and store_keep else None
  bits_ref = opt_refs.pop(0) if dropout and store_bits else None
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
    return cols, k_mask, tiles.outer(q_mask, k_mask), (bh, pl.ds(q0, block_q), pl.ds(k0, block_k))

  def scores(j):
    """Key tile ``j`` of the scores in fp32; keys past ``seq_k`` are ``-inf`` (padded rows
    load 0: finite, never stored)."""
    cols, k_mask, mask, idx = tile(j)
    s = tiles.load(s_ref.at[idx], mask, 0.0).astype(_F32)
    if k_mask is not None:
      s = jnp.where(k_mask[None, :], s, -jnp.inf)
    return s

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
      # block_k is even, so is the tile's start: a hash per two columns with pair_hash.
      u = _dropout.tile_bits16(k0s, k1s, bh.astype(_U32), rows.astype(_U32)[:, None],
                               (j * block_k).astype(_U32), block_k, seq_k, pairs=pair_hash)
      keep = u >= threshold
      # As the reference's apply_dropout: (P * keep) * scale in fp32, rounded once; an
      # invalid traced rate (a NaN scale) gives NaN.
      dropped = (probs.astype(_F32) * keep.astype(_F32) * scale).astype(out_ref.dtype)
      if pd_ref is not None:
        tiles.store(pd_ref.at[idx], dropped, mask)
      if keep_ref is not None:
        tiles.store(keep_ref.at[idx], keep, mask)
      if bits_ref is not None:
        _store_bits(bits_ref, keep, cols, bk, lax.rem(h, _I32(groups)) * seq_q + q0, j,
                    block_q, block_k, q_mask, seq_k // 32)
    else:
      dropped = probs
    v = tiles.load(v_ref.at[bk, pl.ds(j * block_k, block_k), head_dims], tiles.outer(k_mask, d_mask),
              0.0)
    # Padded keys: P = 0 (exp(-inf)) and V = 0.
    return acc + dot(dropped, v)

  acc = jnp.zeros((block_q, d_pad), _F32)
  acc = value(_I32(0), acc, s0) if n_k == 1 else tiles.fori_loop(0, n_k, value, acc)
  o_idx = (b, pl.ds(q0, block_q), h, head_dims)
  o_mask = tiles.outer(q_mask, d_mask)
  if out32_ref is not None:
    tiles.store(out32_ref.at[o_idx], acc, o_mask)
  tiles.store(out_ref.at[o_idx], acc.astype(out_ref.dtype), o_mask)


def _store_bits(bits_ref, keep, cols, bk, row0, j, block_q, block_k, q_mask, seq_words):
  """Key tile ``j`` of ``keep`` (``[block_q, block_k]`` bool, rows ``row0 ...`` of kv group
  ``bk``) as ``block_k / 32`` int32 words per row: bit ``c % 32`` of word ``c // 32`` is
  column ``c``. The tile as ``[block_q, words, 32]`` powers of two, summed over the last
  axis (a sum of distinct bits is their OR; int32 arithmetic wraps, so bit 31 comes out as
  the sign bit). Measured on the H200 against a masked row sum per word (1.3x slower) and the
  words' hashes drawn again as pairs of columns (3% slower):
  ``benchmarks/results/attention_softmax_dropout_value_mosaic_gpu.md``, run 6.
  """
  words = block_k // 32
  one = jnp.ones(keep.shape, jnp.int32)
  bits = jnp.where(keep, lax.shift_left(one, (cols & 31)[None, :]), 0)
  # dtype: under x64 a sum of int32 would be int64.
  value = jnp.sum(bits.reshape(block_q, words, 32), axis=2, dtype=jnp.int32)
  # [words, block_q]: the words' rows are contiguous in the bits array. A ragged last tile
  # holds words past seq_k / 32: they are not stored (they would land in the next group's).
  word_ok = j * words + jnp.arange(words, dtype=jnp.int32) < seq_words
  mask = word_ok[:, None] if q_mask is None else word_ok[:, None] & q_mask[None, :]
  tiles.store(bits_ref.at[bk, pl.ds(j * words, words), pl.ds(row0, block_q)], value.T, mask)


def bits_shape(b, h, kvh, seq_q, seq_k):
  """The shape of the keep bits: ``[B, KVH, seq_k / 32, G * seq_q]`` (int32): bit ``k % 32``
  of word ``k // 32`` of row ``(h % G) * seq_q + q`` of kv group ``(b, h // G)`` is
  ``keep[b, h, q, k]``."""
  return (b, kvh, seq_k // 32, (h // kvh) * seq_q)


def takes(b, h, kvh, seq_q, seq_k, head_dim) -> bool:
  """Whether the kernel takes a problem of these sizes: its int32 offsets reach every element
  of the scores, V and O (fewer than ``2**31`` each)."""
  return max(b * h * seq_q * seq_k, b * kvh * seq_k * head_dim, b * seq_q * h * head_dim) < 2**31


def default_blocks(seq_q: int, seq_k: int) -> tuple[int, int]:
  """``(block_q, block_k)``: the untuned defaults capped at the padded lengths (>= 16)."""
  return (min(DEFAULT_BLOCK_Q, max(16, next_power_of_2(seq_q))),
          min(DEFAULT_BLOCK_K, max(16, next_power_of_2(seq_k))))


@functools.partial(jax.jit, static_argnames=("dropout", "store_probs", "store_dropped",
                                             "store_keep", "store_f32", "store_bits",
                                             "pair_hash", "block_q",
                                             "block_k", "num_warps", "num_stages", "interpret"))
def _call(scores, value_states, seeds, scale, *, dropout, store_probs, store_dropped,
          store_keep, store_f32, store_bits, pair_hash, block_q, block_k, num_warps, num_stages,
          interpret):
  b, h, seq_q, seq_k = scores.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  kernel = functools.partial(
      _kernel, num_heads=h, num_kv_heads=kvh, seq_q=seq_q, seq_k=seq_k, head_dim=d,
      d_pad=tiles.padded_head_dim(d), block_q=block_q, block_k=block_k, dropout=dropout,
      store_probs=store_probs, store_dropped=store_dropped, store_keep=store_keep,
      store_f32=store_f32, pair_hash=pair_hash, store_bits=store_bits)
  flat = (b * h, seq_q, seq_k)
  args = (seeds, scale, scores.reshape(flat), value_states.reshape(b * kvh, seq_k, d))
  o_shape = (b, seq_q, h, d)
  out_shape = [out_struct(o_shape, scores.dtype, *args)]
  if store_probs:
    out_shape.append(out_struct(flat, scores.dtype, *args))
  if store_f32:
    out_shape.append(out_struct(o_shape, _F32, *args))
  pd_out, keep_out = dropout and store_dropped, dropout and store_keep
  if pd_out:
    out_shape.append(out_struct(flat, scores.dtype, *args))
  if keep_out:
    out_shape.append(out_struct(flat, jnp.bool_, *args))
  bits_out = dropout and store_bits
  if bits_out:
    nb, nk, nw, nr = bits_shape(b, h, kvh, seq_q, seq_k)
    out_shape.append(out_struct((nb * nk, nw, nr), jnp.int32, *args))
  out, *rest = pallas_call(
      kernel,
      out_shape=tuple(out_shape),
      grid=(pl.cdiv(seq_q, block_q), b * h),
      compiler_params=compiler_params(num_warps, num_stages),
      interpret=interpret,
      name=_NAME,
  )(*args)
  shape = scores.shape
  probs = rest.pop(0).reshape(shape) if store_probs else None
  out32 = rest.pop(0) if store_f32 else None
  dropped = rest.pop(0).reshape(shape) if pd_out else None
  keep = rest.pop(0).reshape(shape) if keep_out else None
  if bits_out:
    return out, probs, dropped, keep, out32, rest.pop(0).reshape(
        bits_shape(b, h, kvh, seq_q, seq_k))
  return out, probs, dropped, keep, out32


def attention_softmax_dropout_value_forward(scores, value_states, dropout_rate, dropout_rng=None,
                                            *, store_probs: bool = True,
                                            store_dropped: bool = False,
                                            store_keep: bool = True, store_f32: bool = True,
                                            pair_hash: bool = PAIR_HASH, block_q=None,
                                            block_k=None, num_warps=None, num_stages=None,
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
    pair_hash: whether the kernel hashes once per pair of columns (the mask's design: both
      16-bit halves of a hash used) rather than once per element; the same mask either way.
    block_q, block_k: tiles (powers of two >= 16; default :func:`default_blocks`, untuned).
    num_warps, num_stages: Triton launch parameters (default 4 and 3, untuned).
    interpret: run the kernel in the Pallas interpreter (any backend).

  Returns:
    ``O`` ``[B, Sq, H, D]`` in the scores' dtype; ``P`` ``[B, H, Sq, Skv]`` in the scores'
    dtype, or ``None`` with ``store_probs=False``; ``Pd`` likewise, or ``None`` unless
    ``store_dropped``; ``keep`` ``[B, H, Sq, Skv]`` bool, or ``None`` for a concrete rate of
    0 or with ``store_keep=False``; ``O_f32`` ``[B, Sq, H, D]`` fp32, ``O`` before its rounding, or
    ``None`` with ``store_f32=False``.
  """
  for name, flag in (("store_probs", store_probs), ("store_dropped", store_dropped),
                     ("store_keep", store_keep), ("store_f32", store_f32),
                     ("pair_hash", pair_hash)):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(f"{name}: expected a Python bool, got {type(flag).__name__}")
  dropout, launch = _launch_args(scores, value_states, dropout_rate, dropout_rng, block_q,
                                 block_k, num_warps, num_stages, pair_hash, interpret)
  # Without dropout the kernel stores neither Pd nor keep: one compiled kernel for the flags
  # (P, which is Pd then, is written for a Pd asked for).
  out, probs, dropped, keep, out32 = _call(
      scores, value_states, *launch[:2], dropout=dropout,
      store_probs=bool(store_probs) or (bool(store_dropped) and not dropout),
      store_dropped=dropout and bool(store_dropped), store_keep=dropout and bool(store_keep),
      store_f32=bool(store_f32), store_bits=False, **launch[2])
  if store_dropped and not dropout:
    dropped = probs
  return out, probs if store_probs else None, dropped, keep, out32


def forward_with_keep_bits(scores, value_states, dropout_rate, dropout_rng=None, *,
                           pair_hash: bool = PAIR_HASH, block_q=None, block_k=None,
                           num_warps=None, num_stages=None, interpret=False):
  """``(O, P, keep_bits, O_f32)``: :func:`attention_softmax_dropout_value_forward` writing the
  keep mask as bits (``[B, KVH, seq_k / 32, G * seq_q]`` int32, :func:`bits_shape`; 1/8 B per
  attention element instead of the bool mask's 1 B) and no Pd: the residuals of a backward
  that takes ``delta = rowsum(dO * O)`` and rebuilds Pd from P and the bits (the Mosaic GPU
  kernels' ``backward_from_output``). ``keep_bits`` is ``None`` for a concrete rate of 0.

  ``seq_k`` must be a multiple of 32 and the key tile at least 32 wide. Measured on the H200:
  the packing makes this forward slower than one writing Pd (2193 against 1853 us at B=2,
  S=2048, H=80, KVH=8, D=128), so op A's Mosaic GPU backend saves the key instead and its
  backward draws the mask again (``AttentionValueMosaicGpu(keep="bits")`` runs this one).
  """
  dropout, launch = _launch_args(scores, value_states, dropout_rate, dropout_rng, block_q,
                                 block_k, num_warps, num_stages, pair_hash, interpret)
  seq_k = scores.shape[3]
  if seq_k % 32:
    raise ValueError(f"scores: keep bits need seq_k (scores.shape[3]) a multiple of 32, got "
                     f"{seq_k}")
  if launch[2]["block_k"] < 32:
    raise ValueError(f"block_k: keep bits need a key tile of at least 32, got "
                     f"{launch[2]['block_k']}")
  out, probs, _, _, out32, *bits = _call(
      scores, value_states, *launch[:2], dropout=dropout, store_probs=True,
      store_dropped=False, store_keep=False, store_f32=True,
      store_bits=dropout, **launch[2])
  return out, probs, bits[0] if bits else None, out32


def _launch_args(scores, value_states, dropout_rate, dropout_rng, block_q, block_k, num_warps,
                 num_stages, pair_hash, interpret):
  """Checks a forward call; ``(dropout, (seeds, scale, launch keywords))``."""
  if not isinstance(pair_hash, (bool, np.bool_)):
    raise TypeError(f"pair_hash: expected a Python bool, got {type(pair_hash).__name__}")
  _util.check_can_compile(_NAME, interpret, scores, value_states)
  validation.check_scores_and_value(scores, value_states, dtypes=_FLOATS)
  b, h, seq_q, seq_k = scores.shape
  if not takes(b, h, value_states.shape[1], seq_q, seq_k, value_states.shape[3]):
    raise ValueError(f"scores: at most 2**31 - 1 elements per array (int32 offsets), got "
                     f"scores {list(scores.shape)}, value_states {list(value_states.shape)}")
  # The reference's scale, 1 / (1 - p) in fp32, of the rate drawn; NaN for an invalid
  # traced rate.
  dropout, seeds, scale = _dropout.kernel_args(dropout_rate, dropout_rng)
  dq, dk = default_blocks(seq_q, seq_k)
  # Validates the launch parameters (ValueError naming the field).
  cfg = _tuning.TritonPassConfig(
      block_q=dq if block_q is None else block_q, block_k=dk if block_k is None else block_k,
      num_warps=DEFAULT_NUM_WARPS if num_warps is None else num_warps,
      num_stages=DEFAULT_NUM_STAGES if num_stages is None else num_stages)
  return dropout, (seeds, scale, dict(
      pair_hash=bool(pair_hash), block_q=cfg.block_q, block_k=cfg.block_k,
      num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=bool(interpret)))
