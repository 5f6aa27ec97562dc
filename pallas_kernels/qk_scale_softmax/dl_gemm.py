"""The ``"dl_gemm"`` scheme of the qk_scale_softmax backward (Pallas Triton): a kernel writes
``dL``, then one launch computes ``grad_query = dL @ K`` and ``grad_key = dL^T @ Q``.

The ``dL`` kernel holds whole (padded) rows in registers, ``rows`` rows per program, and
reads ``g`` and ``P`` once. The GEMM launch runs a program per ``[block_q, D]`` output tile
of either gradient: the two GEMMs in one grid fill the GPU where each alone would leave it
part idle. Traffic per attention element in bf16: ``g`` and ``P`` read (4 B), ``dL``
written (2 B) and read by each GEMM (4 B): 10 B, and a ``dL`` buffer the size of ``P``.
16-bit inputs with ``D <= 128`` only.

Rows of ``Sk % 8 != 0`` keys (dense, ``DlConfig.phased``) are read and written as row classes
on 16-byte aligned tiles (``pallas_kernels._phase``). Causal: the GEMMs skip the tiles wholly
above the diagonal, so the ``dL`` kernel reads ``g`` and ``P`` only up to the diagonal and
writes ``dL`` (0 above the diagonal) only up to the GEMM tiles' boundary past it; it takes
the rows in classes of halving row lengths (:func:`dl_classes`), so that every program
holds about the same number of elements: about half the dense bytes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _phase
from pallas_kernels import _triton_tiles as tiles
from pallas_kernels._util import (compiler_params, dot, enable_load_cache_modifiers, out_struct,
                                  pallas_call)
from pallas_kernels.qk_scale_softmax import _common as cm
from pallas_kernels.qk_scale_softmax._common import F32, I32, ZERO
from pallas_kernels.qk_scale_softmax.config import DlConfig, PassConfig, dl_width


def takes(dtype, head_dim: int) -> bool:
  """Whether the scheme takes a problem: 16-bit inputs and a padded head dim of at most 128
  (the GEMM launch's tiles must fit shared memory)."""
  return jnp.dtype(dtype).itemsize <= 2 and tiles.padded_head_dim(head_dim) <= 128


def _dl_block(q0, *, bh, scale_ref, g_ref, p_ref, dl_ref, seq_q: int, seq_k: int,
              block_q: int, width: int, renormalize: bool, causal: bool = False,
              causal_tile=None, row_end: int | None = None, whole_blocks: bool | None = None):
  """``dL`` of the rows ``[q0, q0 + block_q)`` of head ``bh`` below ``row_end`` (default
  ``seq_q``; ``whole_blocks``: no row past it, statically), ``width`` keys of each (a power
  of two >= the keys read and written). Causal, ``causal_tile = (R, T)``: row ``i`` is read
  up to the vector of 8 keys holding its diagonal (loads stay 16-byte vectors) and written
  (0 above the diagonal) up to the first multiple of ``T`` keys past the diagonal of the
  last row of its group of ``R`` rows."""
  rows = q0 + jnp.arange(block_q, dtype=I32)
  cols = jnp.arange(width, dtype=I32)
  row_end = seq_q if row_end is None else row_end
  if whole_blocks is None:
    whole_blocks = seq_q % block_q == 0 and row_end == seq_q
  inside = None
  if not (whole_blocks and width == seq_k):
    inside = (rows < row_end)[:, None] & (cols < seq_k)[None, :]
  read = store = inside
  if causal:
    # Keys j <= i + (Sk - Sq) of row i, and the vector of 8 keys holding the last of them.
    end = rows[:, None] + (seq_k - seq_q + 1)
    near = cols[None, :] < (end + 7) // 8 * 8
    read = near if inside is None else inside & near
    group, keys = causal_tile
    last = rows // group * group + group  # 1 + the last row of the row's group
    written = cols[None, :] < (last[:, None] + (seq_k - seq_q) + keys - 1) // keys * keys
    store = written if store is None else store & written
  tile = (bh, pl.ds(q0, block_q), tiles.ds(ZERO, width))
  g = tiles.load(g_ref.at[tile], read, cache_modifier=".cg")
  p = tiles.load(p_ref.at[tile], read, cache_modifier=".cg")
  if causal:  # the keys past the diagonal that the vectors brought in
    below = cols[None, :] < end
    g = jnp.where(below, g, jnp.zeros_like(g))
    p = jnp.where(below, p, jnp.zeros_like(p))
  stats = cm.whole_row_stats(g, p, renormalize)
  dl = cm.dl_tile(g, p, stats, scale_ref[0], dl_ref.dtype)  # 0 where not read
  tiles.store(dl_ref.at[tile], dl, store)


def _dl_kernel(scale_ref, g_ref, p_ref, dl_ref, *, block_q: int, **dims):
  """Dense: ``dL`` of ``block_q`` whole rows of one head."""
  _dl_block(pl.program_id(0) * block_q, bh=pl.program_id(1), scale_ref=scale_ref, g_ref=g_ref,
            p_ref=p_ref, dl_ref=dl_ref, block_q=block_q, **dims)


def dl_classes(seq_q: int, seq_k: int, rows: int,
               causal_tile: tuple[int, int]) -> list[tuple[int, int, int, int]]:
  """The row classes of a causal ``dL`` (``causal_tile = (R, T)``, :func:`_dl_block`):
  ``(lo, hi, width, block_q)`` per class, longest rows first. A class holds the rows whose
  extent (the keys read and written) fits ``width`` (a power of two, halving from
  :func:`dl_width`, down to 64 keys, at most 8 widths: the last class takes every shorter
  row too) but not half of it, ``block_q`` rows per program, so that every program holds
  ``rows * dl_width(seq_k)`` elements. Static (Python ints)."""
  group, keys = causal_tile
  top = dl_width(seq_k)
  i = np.arange(seq_q)
  shift = seq_k - seq_q
  read = np.clip((np.minimum(i + shift + 1, seq_k) + 7) // 8 * 8, 0, None)
  written = np.clip((i // group * group + group + shift + keys - 1) // keys * keys, 0, seq_k)
  extent = np.minimum(np.maximum(read, written), top)
  widths = [top]
  while widths[-1] > 64 and len(widths) < 8:
    widths.append(widths[-1] // 2)
  out, hi = [], seq_q
  for k, width in enumerate(widths):
    last = k == len(widths) - 1
    lo = 0 if last else int(np.searchsorted(extent, width // 2, side="right"))
    lo = min(lo, hi)
    if hi > lo:
      out.append((lo, hi, width, max(1, rows * top // width)))
    hi = lo
  return out


def _dl_kernel_classes(scale_ref, g_ref, p_ref, dl_ref, *, seq_q: int, seq_k: int,
                       classes, causal_tile: tuple[int, int], renormalize: bool):
  """Causal ``dL`` in row classes (:func:`dl_classes`): one program id range per class,
  longest rows first; a program holds ``block_q`` rows of its class's ``width``."""
  pid, bh = pl.program_id(0), pl.program_id(1)  # outside the branches (the interpreter)
  start = 0
  for lo, hi, width, block_q in classes:
    n = pl.cdiv(hi - lo, block_q)

    @pl.when((pid >= start) & (pid < start + n))
    def _(lo=lo, hi=hi, width=width, block_q=block_q, start=start):
      _dl_block((pid - start) * block_q + lo, bh=bh, scale_ref=scale_ref,
                g_ref=g_ref, p_ref=p_ref, dl_ref=dl_ref, seq_q=seq_q, seq_k=seq_k,
                block_q=block_q, width=width, renormalize=renormalize, causal=True,
                causal_tile=causal_tile, row_end=hi, whole_blocks=(hi - lo) % block_q == 0)

    start += n


def _dl_kernel_phased(scale_ref, g_ref, p_ref, dl_ref, *, seq_q: int, seq_k: int,
                      block_q: int, width: int, align: int, renormalize: bool):
  """Dense ``dL`` for rows of ``Sk % 8 != 0`` keys, on 16-byte aligned tiles: one program =
  one row class (``block_q`` rows ``align`` apart, ``pallas_kernels._phase``) of one head,
  the row held from ``phase`` keys early (``width >= Sk + align - 1``), so that ``g`` and
  ``P`` load as 16-byte vectors (the neighbouring rows' columns zeroed) and ``dL`` stores
  its inner vectors whole and at most 7 keys at each end with a scalar mask. All refs but
  ``scale`` are flat 1D views."""
  cls, q0, rows = _phase.class_rows(pl.program_id(0), align, block_q)
  bh = pl.program_id(1)
  ph = _phase.phase(bh * seq_q + cls, seq_k, align)
  base = _phase.aligned_base(bh * seq_q + q0, seq_k, ph, align)
  _, valid, load, vector = _phase.tile_masks(ZERO, seq_k, width, ph)
  row_ok = (rows < seq_q)[:, None]
  inside = row_ok & valid[None, :]
  offs = _phase.tile_offsets(base, seq_k, block_q, ZERO, width, align)
  mask = row_ok & load[None, :]
  g = pltriton.load(g_ref.at[offs], mask=mask, other=0.0)
  p = pltriton.load(p_ref.at[offs], mask=mask, other=0.0)
  g = jnp.where(inside, g, jnp.zeros_like(g))  # the neighbouring rows' keys
  p = jnp.where(inside, p, jnp.zeros_like(p))
  dl = cm.dl_tile(g, p, cm.whole_row_stats(g, p, renormalize), scale_ref[0], dl_ref.dtype)
  tiles.store(dl_ref.at[offs], dl, row_ok & vector[None, :])
  tiles.store(dl_ref.at[offs], dl, row_ok & (valid & jnp.logical_not(vector))[None, :])


def dl_phased(seq_k: int, cfg: DlConfig, causal: bool, *sizes: int) -> bool:
  """Whether :func:`dl_pass` takes :func:`_dl_kernel_phased`: ``cfg.phased``, dense, rows
  not 16-byte aligned (``Sk % 8 != 0``), and flat views that fit int32 offsets."""
  return cfg.phased and not causal and _phase.usable(seq_k, *sizes)


@functools.partial(jax.jit, static_argnames=("causal", "cfg", "interpret", "causal_tile",
                                             "renormalize"))
def dl_pass(scale, g, p, *, causal=False, cfg, interpret, causal_tile=None, renormalize=False):
  """``dL [B*H, Sq, Sk]`` (the input dtype, in the form ``renormalize`` names: ``_common``,
  rounded as the reference rounds it) from 3D ``[B*H, Sq, Sk]`` views of ``g`` and ``P``,
  ``g`` and ``P`` read once. Dense:
  ``cfg.rows`` whole rows per program (:func:`_dl_kernel`, or :func:`_dl_kernel_phased`
  where :func:`dl_phased`). Causal (``causal_tile = (R, T)`` required): the row classes of
  :func:`dl_classes`; ``dL`` is 0 above the diagonal up to the first multiple of ``T`` keys
  past the diagonal of the last row of each group of ``R`` rows, and unwritten past it,
  where GEMMs with tiles :func:`causal_tile_of` never read it."""
  bh, seq_q, seq_k = g.shape
  if dl_phased(seq_k, cfg, causal, g.size):
    align, block = _phase.resolve(_phase.ALIGN, seq_q, cfg.rows, _phase.ALIGN)
    width = dl_width(seq_k + align - 1)  # the row from up to align - 1 keys early
    dl = pallas_call(
        functools.partial(_dl_kernel_phased, seq_q=seq_q, seq_k=seq_k, block_q=block,
                          width=width, align=align, renormalize=renormalize),
        out_shape=out_struct((bh * seq_q * seq_k,), g.dtype, g, p),
        grid=(_phase.num_programs(seq_q, align, block), bh),
        compiler_params=compiler_params(cfg.num_warps, 1),
        interpret=interpret,
        name="qk_scale_softmax_bwd_dl",
    )(scale, g.reshape(-1), p.reshape(-1))
    return dl.reshape(bh, seq_q, seq_k)
  enable_load_cache_modifiers("the dL kernel's .cg loads")
  if causal:
    if causal_tile is None:
      raise ValueError("dl_pass: a causal dL needs the GEMMs' causal_tile")
    classes = dl_classes(seq_q, seq_k, cfg.rows, causal_tile)
    kernel = functools.partial(_dl_kernel_classes, seq_q=seq_q, seq_k=seq_k, classes=classes,
                               causal_tile=causal_tile, renormalize=renormalize)
    programs = sum(pl.cdiv(hi - lo, block_q) for lo, hi, _, block_q in classes)
  else:
    kernel = functools.partial(_dl_kernel, seq_q=seq_q, seq_k=seq_k, block_q=cfg.rows,
                               width=dl_width(seq_k), renormalize=renormalize)
    programs = pl.cdiv(seq_q, cfg.rows)
  return pallas_call(
      kernel,
      out_shape=out_struct((bh, seq_q, seq_k), g.dtype, g, p),
      grid=(programs, bh),
      compiler_params=compiler_params(cfg.num_warps, 1),
      interpret=interpret,
      name="qk_scale_softmax_bwd_dl",
  )(scale, g, p)


def _and_masks(*masks):
  masks = [m for m in masks if m is not None]
  out = masks[0] if masks else None
  for m in masks[1:]:
    out = out & m
  return out


def _gemm_tile(i, head, dl_ref, x_ref, o_ref, *, transpose: bool, causal: bool, rotate: bool,
               seq_q: int, seq_k: int, head_dim: int, block_q: int, block_k: int):
  """Output tile ``i`` of head ``head``: ``dL @ K`` (``transpose=False``: ``block_q`` query
  rows, the loop over key tiles) or ``dL^T @ Q`` (``block_k`` key rows, the loop over query
  tiles). Causal: only the tiles that meet the diagonal's lower side, which hold 0 above it
  (:func:`dl_pass`); masking them here instead would take the tiles through registers and
  cost the GEMM its pipelining. ``rotate`` (:func:`_rotates`): the loop starts at the
  diagonal block and wraps around, so that the ``grad_query`` tile of row block ``i`` and
  the ``grad_key`` tile of key block ``c`` read dL's block ``(i, c)`` in the same step,
  ``(c - i) mod n``: the second read comes from L2."""
  d_pad = tiles.padded_head_dim(head_dim)
  d_ok = None if d_pad == head_dim else (jnp.arange(d_pad, dtype=I32) < head_dim)[None, :]
  out_block, red_block = (block_k, block_q) if transpose else (block_q, block_k)
  out_len, red_len = (seq_k, seq_q) if transpose else (seq_q, seq_k)

  def ok(start, block, length, axis):
    """Which of the tile's ``block`` indices from ``start`` lie below ``length``, as a
    column (``axis=0``) or a row (``axis=1``); ``None``: all of them in every tile."""
    if length % block == 0:
      return None
    m = start + jnp.arange(block, dtype=I32) < length
    return m[:, None] if axis == 0 else m[None, :]

  o0 = i * out_block
  # Rotated, step t of the grad_query tile of row block i reads key block (i + t) mod n and
  # step t of the grad_key tile of key block c reads row block (c - t) mod n, in blocks of
  # out_block (per reduction steps each).
  per = out_block // red_block
  n = out_len // out_block

  def step(j):
    """The reduction step that iteration ``j`` takes."""
    if not rotate:
      return j
    if not transpose:
      return lax.rem(j + i * I32(per), I32(n * per))
    return (lax.rem(i - lax.div(j, I32(per)) + I32(n), I32(n)) * I32(per)
            + lax.rem(j, I32(per)))

  def body(j, acc):
    r0 = step(j) * red_block
    if transpose:  # dL tile [red (queries), out (keys)]
      idx = (head, pl.ds(r0, red_block), pl.ds(o0, out_block))
      a_mask = _and_masks(ok(r0, red_block, red_len, 0), ok(o0, out_block, out_len, 1))
    else:  # dL tile [out (queries), red (keys)]
      idx = (head, pl.ds(o0, out_block), pl.ds(r0, red_block))
      a_mask = _and_masks(ok(o0, out_block, out_len, 0), ok(r0, red_block, red_len, 1))
    a = tiles.load(dl_ref.at[idx], a_mask)
    x = tiles.load(x_ref.at[head, pl.ds(r0, red_block), tiles.ds(ZERO, d_pad)],
                   _and_masks(ok(r0, red_block, red_len, 0), d_ok))
    return acc + dot(a, x, trans_a=transpose)

  lo, hi = 0, pl.cdiv(red_len, red_block)
  if causal and transpose:
    lo = cm.col_first_q_tile(i, seq_q, seq_k, block_q, block_k)
  elif causal:
    hi = cm.row_num_k_tiles(i, seq_q, seq_k, block_q, block_k)
  acc = tiles.fori_loop(lo, hi, body, jnp.zeros((out_block, d_pad), F32))
  tiles.store(o_ref.at[head, pl.ds(o0, out_block), tiles.ds(ZERO, d_pad)],
              acc.astype(o_ref.dtype), _and_masks(ok(o0, out_block, out_len, 0), d_ok))


def _rotates(causal: bool, seq_q: int, seq_k: int, dq: PassConfig) -> bool:
  """Whether the GEMM launch walks rotated and interleaved: dense square problems of whole
  ``[block_q, block_q]`` blocks (``dq``: the grad_query tiles), where every grad_query tile
  has its grad_key twin reading the same blocks of dL."""
  return (not causal and seq_q == seq_k and seq_q % dq.block_q == 0
          and dq.block_q % dq.block_k == 0)


def _gemms_kernel(dl_ref, k_ref, q_ref, dq_ref, dk_ref, *, q_tiles: int, interleave: bool,
                  dq_dims, dk_dims):
  """The ``grad_query`` and the ``grad_key`` tiles of one head, in one launch: the first
  ``q_tiles`` programs of the grid's first axis and the rest, or (``interleave``, as many
  of each) the even and the odd programs, so that twin tiles run side by side."""
  pid, bh = pl.program_id(0), pl.program_id(1)
  if interleave:
    is_dq, dq_tile, dk_tile = pid % 2 == 0, pid // 2, pid // 2
  else:
    is_dq, dq_tile, dk_tile = pid < q_tiles, pid, pid - q_tiles

  @pl.when(is_dq)
  def _dq():
    _gemm_tile(dq_tile, bh, dl_ref, k_ref, dq_ref, transpose=False, **dq_dims)

  @pl.when(jnp.logical_not(is_dq))
  def _dk():
    _gemm_tile(dk_tile, bh, dl_ref, q_ref, dk_ref, transpose=True, **dk_dims)


@functools.partial(jax.jit, static_argnames=("causal", "cfg", "interpret"))
def dl_gemms(dl, q, k, *, causal: bool = False, cfg: PassConfig, interpret):
  """``(dL @ K, dL^T @ Q)`` (``grad_query``, ``grad_key``) from ``dL [B*H, Sq, Sk]``, ``Q
  [B*H, Sq, D]`` and ``K [B*H, Sk, D]`` in one Triton launch: a program computes one
  ``[block_q, D]`` output tile of either (``grad_query``: ``block_q`` query rows, steps of
  ``block_k`` keys; ``grad_key``: ``block_q`` keys, steps of ``block_k`` query rows; tiles
  capped at the padded lengths), fp32 accumulation, rounded once. ``causal``: ``dL`` is 0
  above the diagonal where these tiles read it, and the tiles wholly above it are skipped."""
  bh, seq_q, seq_k = dl.shape
  head_dim = q.shape[-1]
  # grad_key's tiles are cfg's transposed (block_q keys, block_k query rows).
  dq = cfg.capped(seq_q, seq_k)
  dk = dataclasses.replace(cfg, block_q=cfg.block_k, block_k=cfg.block_q).capped(seq_q, seq_k)
  rotate = _rotates(causal, seq_q, seq_k, dq)
  common = dict(causal=causal, rotate=rotate, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim)
  dq_dims = dict(common, block_q=dq.block_q, block_k=dq.block_k)
  dk_dims = dict(common, block_q=dk.block_q, block_k=dk.block_k)
  q_tiles = pl.cdiv(seq_q, dq_dims["block_q"])
  grid = (q_tiles + pl.cdiv(seq_k, dk_dims["block_k"]), bh)
  like = (dl, q, k)
  return pallas_call(
      functools.partial(_gemms_kernel, q_tiles=q_tiles, interleave=rotate, dq_dims=dq_dims,
                        dk_dims=dk_dims),
      out_shape=(out_struct((bh, seq_q, head_dim), q.dtype, *like),
                 out_struct((bh, seq_k, head_dim), k.dtype, *like)),
      grid=grid,
      compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=interpret,
      name="qk_scale_softmax_bwd_dl_gemms",
  )(dl, k, q)


def causal_tile_of(*cfgs: PassConfig) -> tuple[int, int]:
  """:func:`dl_pass`'s ``causal_tile`` for the GEMMs of ``cfgs`` (their tiles read ``dL`` in
  blocks of ``block_q`` x ``block_k`` and ``block_k`` x ``block_q``, up to the ones that
  meet the diagonal): the largest tile side, as both (tiles are powers of two)."""
  side = max(max(c.block_q, c.block_k) for c in cfgs)
  return side, side


def dl_gemm(scale, g, p, q, k, *, causal=False, cfg: DlConfig, interpret, renormalize=False):
  """The scheme on 3D ``[B*H, ...]`` views: ``dL`` from :func:`dl_pass`, then
  ``(grad_query, grad_key)`` from :func:`dl_gemms` (tiles ``cfg.gemm``)."""
  causal_tile = causal_tile_of(cfg.gemm) if causal else None
  dl = dl_pass(scale, g, p, causal=causal, cfg=cfg, interpret=interpret,
               causal_tile=causal_tile, renormalize=renormalize)
  return dl_gemms(dl, q, k, causal=causal, cfg=cfg.gemm, interpret=interpret)
