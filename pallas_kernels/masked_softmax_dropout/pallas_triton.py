"""Masked softmax -> dropout backward: the Pallas Triton row kernel and its entry points.

Forward (for context): ``P = softmax(scores.masked_fill(~mask, -1e4))``,
``y = P * keep / (1 - p)``. Backward, all fp32 inside::

    gd = g * keep / (1 - p)        (gd = g when p == 0; keep is then not read)
    s  = rowsum(P * gd)            (over all columns: the mask is not applied)
    dS = where(mask, P * (gd - s), 0)

One program owns ``block_rows`` whole rows of one head, issues all its loads together (one
round trip to memory), reduces the row sums in registers and writes dS once. A row of odd
length is one chunk padded to the next power of two or two power-of-two chunks
(:func:`~pallas_kernels.masked_softmax_dropout.config.column_chunks`). Traffic per fp32
element: g, P (4 + 4 B) and keep (1 B) in, dS (4 B) out, plus the ``[B, 1, Sq, Sk]`` mask
shared by the heads, whose programs run together under ``row_group=0`` (the default) so the
mask tile comes from L2 after its first read; the H200 table sets ``row_group=65536`` (a
head's row blocks first) for some row classes. A mask that broadcasts (``[B, 1, 1, Sk]``,
``[Sq, Sk]``, ...) is read through its own shape: a broadcast axis at index 0, broadcast in
registers. The launch config comes from ``config.default_config``.

``masked_softmax_dropout_backward_from_scores`` is the op's backward: the same kernel given
the scores instead of P, which it recomputes as the fused forward does, and the dropout key
instead of keep, which it redraws (``pallas_kernels._dropout``): 4 + 4 B in, 4 B out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _dropout, _tuning, _util, validation
from pallas_kernels._util import Dropout, compiler_params, out_struct, pallas_call
from pallas_kernels.masked_softmax_dropout.config import Config, column_chunks, default_config
from pallas_kernels.masked_softmax_dropout.forward import load_mask, mask_operand, masked_fill

_NAME = "masked_softmax_dropout_backward"


def _unpack_refs(refs, dropout: Dropout):
  """``(scale_ref, g_ref, p_ref, mask_ref, keep_ref, o_ref)``; absent refs are ``None``.

  ``scale_ref`` (traced rate only) holds ``[1 / (1 - p), p > 0]``; ``keep_ref`` is absent
  when the rate is a concrete 0, and holds the key's ``[k0, k1, threshold]`` when the mask
  is drawn in the kernel.
  """
  if dropout.mode == "traced":
    return refs
  if dropout.mode == "none":
    g_ref, p_ref, mask_ref, o_ref = refs
    return None, g_ref, p_ref, mask_ref, None, o_ref
  g_ref, p_ref, mask_ref, keep_ref, o_ref = refs
  return None, g_ref, p_ref, mask_ref, keep_ref, o_ref


def _hashed_keep(seeds_ref, bh, rows, c0, width, seq_k):
  """The keep mask of the tile of ``width`` columns from ``c0``, drawn from the key's
  seeds ``[k0, k1, threshold]`` (uint32) as ``jax_ops.dropout_keep_mask`` draws it."""
  u32 = jnp.uint32
  u = _dropout.tile_bits16(seeds_ref[0], seeds_ref[1], bh.astype(u32),
                           rows.astype(u32)[:, None], jnp.asarray(c0).astype(u32), width,
                           seq_k, pairs=False)
  return u >= seeds_ref[2]


def _load_keep(keep_ref, scale_ref, tile, valid, dropout: Dropout, stream: dict):
  """The tile's keep mask as read (``None`` when the rate is a concrete 0)."""
  if dropout.mode == "none":
    return None
  if dropout.mode == "traced":
    # A traced rate: when it is 0 the predicated-off load never touches memory.
    return pltriton.load(keep_ref.at[tile], mask=valid & (scale_ref[1] > 0), other=True,
                         **stream)
  return pltriton.load(keep_ref.at[tile], mask=valid, other=False, **stream)


def _fill(dropout: Dropout, scale_ref):
  """The value of masked elements: 0; with a traced rate, 0 * (1 / (1 - p)): NaN for an
  invalid rate, so that then every element is NaN, as in the reference."""
  return 0.0 if dropout.mode != "traced" else 0.0 * scale_ref[0]


def _dropped_grad(g, keep, scale_ref, dropout: Dropout, drawn: bool):
  """``gd = g * keep / (1 - p)`` for one tile in fp32 (``g`` when the rate is a concrete
  0); ``drawn``: the mask was drawn from the key, so a traced invalid rate must give NaN
  here (a read mask's loads are predicated off at rate 0 instead)."""
  g = g.astype(jnp.float32)
  if dropout.mode == "none":
    return g
  if dropout.mode == "traced":
    return jnp.where(keep, g * scale_ref[0], _fill(dropout, scale_ref) if drawn else 0.0)
  return jnp.where(keep, g * dropout.scale, 0.0)


def _load_mask(mask_ref, mask_broadcast, b, r0, c0, block_rows, width, valid, seq_q, seq_k,
               config: Config):
  return load_mask(mask_ref, mask_broadcast, b, r0, block_rows, c0, width, valid, seq_q, seq_k,
                   cache_modifier=config.mask_cache)


def _grid(batch, num_heads, seq_q, config: Config):
  """``(heads, batch * row blocks)`` with heads fastest (``row_group`` 0), else one axis in
  :attr:`Config.row_group` order (:func:`_program_tile` decodes it)."""
  n_blocks = pl.cdiv(seq_q, config.block_rows)
  if config.row_group == 0:
    return (num_heads, batch * n_blocks)
  group = min(config.row_group, n_blocks)
  return (batch * num_heads * pl.cdiv(n_blocks, group) * group,)


def _program_tile(num_heads, seq_q, config: Config):
  """``(head, batch entry, first row)`` of this program. Where a row group does not divide
  the row blocks, the last programs get rows >= ``seq_q``: every access of theirs is masked
  off."""
  n_blocks = pl.cdiv(seq_q, config.block_rows)
  if config.row_group == 0:
    t = pl.program_id(1)
    return pl.program_id(0), t // n_blocks, (t % n_blocks) * config.block_rows
  group = min(config.row_group, n_blocks)
  n_groups = pl.cdiv(n_blocks, group)
  p = pl.program_id(0)
  in_group, p = p % group, p // group
  h, p = p % num_heads, p // num_heads
  block = (p % n_groups) * group + in_group
  return h, p // n_groups, block * config.block_rows


def _softmax(tiles, dtype):
  """P of a block of whole rows from its scores, per chunk (fp32, rounded to ``dtype``
  first): the forward kernel's ``masked_softmax`` over chunks ``(scores, attend, valid)``."""
  filled = [masked_fill(s, attend, valid) for s, attend, valid in tiles]
  top = functools.reduce(jnp.maximum, [jnp.max(f, axis=1, keepdims=True) for f in filled])
  exps = [jnp.exp(f - top) for f in filled]
  total = sum(jnp.sum(e, axis=1, keepdims=True) for e in exps)
  return [(e / total).astype(dtype).astype(jnp.float32) for e in exps]


def _kernel(*refs, num_heads, seq_q, seq_k, config: Config, dropout: Dropout, hashed: bool,
            from_scores: bool, mask_broadcast):
  """One program: ``block_rows`` whole rows of one head (:func:`_program_tile`), in
  power-of-two column chunks, every byte read once. ``hashed``: ``keep_ref`` holds the key's
  seeds; ``from_scores``: ``p_ref`` holds the scores; ``mask_broadcast``: the mask's
  broadcast axes (``forward.mask_operand``)."""
  scale_ref, g_ref, p_ref, mask_ref, keep_ref, o_ref = _unpack_refs(refs, dropout)
  h, b, r0 = _program_tile(num_heads, seq_q, config)
  bh = b * num_heads + h
  rows_n = config.block_rows
  rows = r0 + jnp.arange(rows_n)
  stream = dict(cache_modifier=config.stream_cache, eviction_policy=config.stream_eviction)
  # P recomputed from the scores needs the mask first.
  mask_first = from_scores or not config.mask_after_sum
  chunks = []
  for c0, width in column_chunks(seq_k, config.split):
    # A traced start: a constant one past the row's end fails the indexer's static bounds
    # check even though the masked access is fine.
    c0 = h * 0 + c0
    cols = c0 + jnp.arange(width)
    valid = (rows[:, None] < seq_q) & (cols[None, :] < seq_k)
    tile = (bh, pl.ds(r0, rows_n), pl.ds(c0, width))
    g = pltriton.load(g_ref.at[tile], mask=valid, other=0.0, **stream)
    x = pltriton.load(p_ref.at[tile], mask=valid, other=0.0, **stream)
    keep = None if hashed else _load_keep(keep_ref, scale_ref, tile, valid, dropout, stream)
    attend = _load_mask(mask_ref, mask_broadcast, b, r0, c0, rows_n, width, valid, seq_q,
                        seq_k, config) if mask_first else None
    chunks.append((c0, width, valid, g, x, keep, attend))

  if from_scores:
    probs = _softmax([(x, attend, valid) for _, _, valid, _, x, _, attend in chunks],
                     o_ref.dtype)
  else:
    probs = [x.astype(jnp.float32) for *_, x, _, _ in chunks]
  total = jnp.zeros((rows_n, 1), jnp.float32)
  gds = []
  for (c0, width, _, g, _, keep, _), prob in zip(chunks, probs):
    if hashed and dropout.mode != "none":
      keep = _hashed_keep(keep_ref, bh, rows, c0, width, seq_k)
    gd = _dropped_grad(g, keep, scale_ref, dropout, drawn=hashed)
    total = total + jnp.sum(prob * gd, axis=1, keepdims=True)
    gds.append(gd)
  fill = _fill(dropout, scale_ref)
  for (c0, width, valid, _, _, _, attend), prob, gd in zip(chunks, probs, gds):
    if attend is None:
      attend = _load_mask(mask_ref, mask_broadcast, b, r0, c0, rows_n, width, valid, seq_q,
                          seq_k, config)
    out = jnp.where(attend, prob * (gd - total), fill)
    pltriton.store(o_ref.at[bh, pl.ds(r0, rows_n), pl.ds(c0, width)], out.astype(o_ref.dtype),
                   mask=valid, eviction_policy=config.store_eviction)


@functools.partial(jax.jit, static_argnames=("dropout", "config", "interpret", "hashed",
                                             "from_scores"))
def _call(grad_output, p_attn, mask, dropout_mask, p_dropout, *, dropout: Dropout,
          config: Config, interpret: bool, hashed: bool = False, from_scores: bool = False):
  """``hashed``: ``dropout_mask`` is the key's ``[k0, k1, threshold]`` (uint32), not a mask;
  ``from_scores``: ``p_attn`` holds the scores, from which the kernel recomputes P."""
  b, h, seq_q, seq_k = p_attn.shape
  if config.uses_cache_modifiers:
    _util.enable_load_cache_modifiers("config.stream_cache / config.mask_cache",
                                      "use None")
  mask, mask_broadcast = mask_operand(mask, b, seq_q, seq_k)
  kernel = functools.partial(_kernel, num_heads=h, seq_q=seq_q, seq_k=seq_k, config=config,
                             dropout=dropout, hashed=hashed, from_scores=from_scores,
                             mask_broadcast=mask_broadcast)
  args = [grad_output.reshape(b * h, seq_q, seq_k), p_attn.reshape(b * h, seq_q, seq_k), mask]
  if dropout.mode == "traced":
    p = jnp.asarray(p_dropout, jnp.float32)
    # An invalid traced rate (outside [0, 1), NaN) gives NaN gradients, not wrong ones.
    inv = validation.nan_unless_rate_valid(p, 1.0 / (1.0 - p))
    args.insert(0, jnp.stack([inv, (p > 0).astype(jnp.float32)]))
  if dropout.mode != "none":
    args.append(dropout_mask if hashed else dropout_mask.reshape(b * h, seq_q, seq_k))
  out = pallas_call(
      kernel,
      out_shape=out_struct((b * h, seq_q, seq_k), p_attn.dtype, *args),
      grid=_grid(b, h, seq_q, config),
      compiler_params=compiler_params(config.num_warps, 1),
      interpret=interpret,
      name=_NAME,
  )(*args)
  return out.reshape(b, h, seq_q, seq_k)


def _resolve_config(config, p_attn, grad_output, interpret) -> Config:
  if config is None:
    device_kind = _tuning.device_kind_of(p_attn, grad_output, interpret=interpret)
    return default_config(p_attn.shape[2], p_attn.shape[3], device_kind)
  if not isinstance(config, Config):
    raise TypeError(f"config: expected a masked_softmax_dropout.Config, got {config!r}")
  return config


def masked_softmax_dropout_backward(
    grad_output: jax.typing.ArrayLike, p_attn: jax.typing.ArrayLike, mask: jax.typing.ArrayLike,
    dropout_mask: jax.typing.ArrayLike | None, p_dropout: float | jax.typing.ArrayLike, *,
    config: Config | None = None, causal: bool = False, interpret: bool = False) -> jax.Array:
  """Gradient of the scores through masked softmax and dropout.

  Args:
    grad_output: ``[B, H, Sq, Sk]`` float (fp32 in the usual case), gradient of the
      dropout output.
    p_attn: ``[B, H, Sq, Sk]``, same dtype, the softmax output P.
    mask: bool, True = attend: ``[B, 1, Sq, Sk]`` or any shape that broadcasts to it
      (``pallas_kernels.validation.check_mask``: ``[B, 1, 1, Sk]``, ``[Sq, Sk]``, ...),
      read through its broadcast axes, never materialized.
    dropout_mask: ``[B, H, Sq, Sk]`` bool, True = kept. Never read when the rate is 0 (it
      may then be ``None`` if the rate is a Python number).
    p_dropout: dropout rate in [0, 1): a Python float, or a traced scalar (one outside
      [0, 1) gives NaN gradients, since nothing can raise at run time).
    config: launch configuration; default: tuned for the device that holds the arrays,
      else a heuristic.
    causal: accepted for a uniform interface across the kernels, and ignored: a causal
      attention is a mask (and a P that is zero above the diagonal), which the dense math
      handles as any other.
    interpret: run the kernel in the Pallas interpreter (any backend).

  Returns:
    ``grad_scores [B, H, Sq, Sk]`` in the dtype of ``p_attn``.
  """
  del causal  # see above: the dense math covers it
  grad_output, p_attn, mask, dropout_mask = validation.as_jax(grad_output, p_attn, mask,
                                                              dropout_mask)
  _util.check_can_compile(_NAME, interpret, grad_output, p_attn, mask, dropout_mask)
  p = validation.check_masked_softmax_dropout(grad_output, p_attn, mask, dropout_mask,
                                              p_dropout)
  config = _resolve_config(config, p_attn, grad_output, interpret)
  return _call(grad_output, p_attn, mask, dropout_mask, p_dropout, dropout=Dropout.of(p),
               config=config, interpret=interpret)


def masked_softmax_dropout_backward_from_scores(grad_output, scores, mask, dropout_rng,
                                                p_dropout, *, config: Config | None = None,
                                                interpret: bool = False):
  """:func:`masked_softmax_dropout_backward` given the scores and the dropout key.

  The kernel recomputes ``P = softmax(scores.masked_fill(~mask, -1e4))`` (fp32, rounded to
  the scores' dtype) from the rows it holds, as the fused forward does, and draws the keep
  mask from ``dropout_rng``: ``jax_ops.dropout_keep_mask(dropout_rng, p_dropout, shape)``
  bit for bit. So the forward stores neither P nor the mask. ``scores [B, H, Sq, Sk]``;
  ``p_dropout`` is the rate as given (a Python float or a traced scalar); the kernel scales
  by the rate the mask draws (``pallas_kernels._dropout.effective_rate``). The other
  arguments as there.
  """
  _util.check_can_compile(_NAME, interpret, grad_output, scores, mask)
  # The keep mask is not an argument: its shape stands in for the check.
  p = validation.check_masked_softmax_dropout(
      grad_output, scores, mask, jax.ShapeDtypeStruct(getattr(scores, "shape", ()), jnp.bool_),
      p_dropout, rows_name="scores")
  config = _resolve_config(config, scores, grad_output, interpret)
  if p == 0.0:
    return _call(grad_output, scores, mask, None, 0.0, dropout=Dropout.of(0.0), config=config,
                 interpret=interpret, from_scores=True)
  if dropout_rng is None:
    raise ValueError("dropout_rng: a p_dropout that may be > 0 needs a PRNG key")
  given = p if p is not None else jnp.asarray(p_dropout, jnp.float32)
  rate = _dropout.effective_rate(given)
  if p is None:  # a traced rate: an invalid one gives NaN (the scale), as the keep-mask path
    rate = validation.nan_unless_rate_valid(given, rate)
  return _call(grad_output, scores, mask, _dropout.seeds(dropout_rng, given), rate,
               dropout=Dropout.of(rate if p is not None else None), config=config,
               interpret=interpret, hashed=True, from_scores=True)
