"""Op A's forward as one Pallas Mosaic GPU kernel (Hopper, sm_90a): softmax -> dropout ->
GQA P·V, writing ``O``, ``P`` and the fp32 ``O`` (what the op's ``"fused_output"`` residual
policy saves), the keep mask drawn in the kernel from the key's seeds.

A program owns 128 rows of one kv group's ``[G * seq_q, seq_k]`` slab (64 per consumer
warpgroup; the query heads of a group are consecutive rows, sharing V) and runs one
warp-specialized pipeline of ``2 * seq_k / 64`` steps: a TMA warpgroup streams the scores'
``[128, 64]`` tiles twice, with V's ``[64, D]`` tiles, and the two consumer warpgroups

1. (the first ``seq_k / 64`` steps) take the row max ``m`` and sum ``l`` of ``exp(s - m)``,
   online;
2. (the rest) compute ``P = exp(s - m) * (1 / l)`` (rounded to the scores' dtype, as
   ``jax.nn.softmax`` then a cast), store it through shared memory with TMA, draw keep
   (:func:`pallas_kernels.attention_softmax_dropout_value.pallas_mosaic_gpu._drawn_keep`,
   the mask of ``jax_ops.dropout_keep_mask``), form ``Pd = bf16(P * keep * scale)`` in
   registers, stage it in shared memory and accumulate ``O += Pd @ V`` with wgmma.

Bytes: the scores twice and P once, 6 B per attention element (V from L2). Supported
(:func:`unsupported_reason`): bf16 or fp16, ``D`` of 64 or 128, ``seq_q % 64 == 0``,
``seq_k % 64 == 0``, ``(G * seq_q) % 128 == 0``, a static rate.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _mosaic
from pallas_kernels._util import dropout_scale, out_struct
from pallas_kernels.attention_softmax_dropout_value import pallas_mosaic_gpu as _mg

f32 = jnp.float32
i32 = np.int32
ROWS = 64        # rows per consumer warpgroup
KEYS = 64        # keys per step
WGS = 2


def unsupported_reason(b, h, kvh, sq, skv, d, dtype, p_static) -> str | None:
  """Why this kernel cannot run a problem (``None``: it can); ``p_static`` the rate as a
  float, ``None`` when traced."""
  why = _mg.tile_reason(dtype, d, sq)
  if why:
    return why
  if skv % KEYS:
    return f"seq_k {skv} (a multiple of {KEYS} only)"
  if ((h // kvh) * sq) % (WGS * ROWS):
    return f"G * seq_q = {(h // kvh) * sq} (a multiple of {WGS * ROWS} only)"
  if p_static is None:
    return "a traced dropout rate (static rates only)"
  return None


def _kernel(s_ref, v_ref, seeds_ref, o_ref, p_ref, o32_ref, p_stage, pd_stage, o_stage, *,
            kvh_count, g, sq, skv, d, keep_scale, keep_hash, stages, delay):
  bk = lax.axis_index("bk")
  rb = lax.axis_index("rows")
  wg = lax.axis_index("wg")
  b = lax.div(bk, i32(kvh_count))
  kvh = lax.rem(bk, i32(kvh_count))
  n_k = skv // KEYS
  tile = rb * WGS + wg                         # this warpgroup's row tile in the group
  row0 = tile * ROWS
  head = kvh * g + lax.div(row0, i32(sq))
  q0 = lax.rem(row0, i32(sq))
  dtype = p_ref.dtype
  wg_rows = pl.ds(wg * ROWS, ROWS)

  def compute_context(run_pipeline):
    def run(acc_ref):
      m = jnp.full((ROWS,), -jnp.inf, f32)
      l = jnp.zeros((ROWS,), f32)
      run_pipeline((acc_ref, m, l))
      plgpu.wgmma_wait(0)
      return acc_ref[...]
    acc = pl.run_scoped(run, plgpu.ACC((ROWS, d), f32))
    o32_ref.at[b, pl.ds(q0, ROWS), head][...] = acc
    o_stage[wg] = acc.astype(o_stage.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_stage.at[wg], o_ref.at[b, pl.ds(q0, ROWS), head])
    plgpu.wait_smem_to_gmem(0)

  def step(idx, s_smem, v_smem, carry):
    (j,) = idx
    acc, m, l = carry
    jj = j - n_k                                 # the key tile of pass 2
    s = plgpu.load(s_smem.at[wg_rows], layout=plgpu.Layout.WGMMA).astype(f32)
    plgpu.commit_smem()    # the slot's loads, ordered before the pipeline's refill (TMA)

    # The two passes' arithmetic as a cond without side effects (the Mosaic GPU interpreter
    # takes none in a cond with results; the seeds' scalar reads are its only memory
    # reads); pass 1 gives zeros for P and Pd, which the GEMM adds to O, and stores nothing.
    def stats(s, m, l):
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      l_new = (l * jnp.exp(m - m_new)
               + jnp.sum(jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), axis=1))
      zeros = jnp.zeros(s.shape, dtype)
      return m_new, l_new, zeros, zeros

    def value(s, m, l):
      e = jnp.exp(s - lax.broadcast_in_dim(m, s.shape, [0]))
      probs = (e * lax.broadcast_in_dim(1.0 / l, s.shape, [0])).astype(dtype)
      if keep_scale is None:
        dropped = probs
      else:
        kept = _mg._drawn_keep(seeds_ref, tile, b, kvh, jj * KEYS, keep_hash)
        # As the reference: (P * keep) * scale in fp32, rounded once.
        dropped = jnp.where(kept, probs.astype(f32) * keep_scale, 0.0).astype(dtype)
      return m, l, probs, dropped

    m, l, probs, dropped = lax.cond(j < n_k, stats, value, s, m, l)

    @pl.when(j >= n_k)
    def _store_p():
      slot = lax.rem(jj, i32(2))
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)      # the slot's last store read it
      p_stage[wg, slot] = probs
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          p_stage.at[wg, slot], p_ref.at[b, kvh, pl.ds(row0, ROWS), pl.ds(jj * KEYS, KEYS)])

    if delay:
      # Two staging tiles; this step's GEMM is waited for in the next step (wgmma groups
      # complete in order), and the pipeline releases a step's slots one step later.
      stage = pd_stage.at[wg, lax.rem(j, i32(2))]
      stage[...] = dropped
      plgpu.commit_smem()
      plgpu.wgmma(acc, stage, v_smem)
      plgpu.wgmma_wait(1)
    else:
      stage = pd_stage.at[wg, 0]
      stage[...] = dropped    # the GEMM's A operand (the last step's GEMM was waited for)
      plgpu.commit_smem()
      plgpu.wgmma(acc, stage, v_smem)
      plgpu.wgmma_wait(0)
    return acc, m, l

  tiled = _mosaic.tiled(dtype)
  pipeline = plgpu.emit_pipeline_warp_specialized(
      step, grid=(2 * n_k,), max_concurrent_steps=stages,
      memory_registers=_mosaic.MEMORY_REGISTERS, num_compute_wgs=WGS, wg_axis="wg",
      compute_context=compute_context,
      in_specs=[
          plgpu.BlockSpec((WGS * ROWS, KEYS), lambda j: (rb, lax.rem(j, i32(n_k))),
                          transforms=tiled, delay_release=int(delay)),
          plgpu.BlockSpec((KEYS, d), lambda j: (jnp.maximum(j - n_k, 0), 0),
                          transforms=tiled, delay_release=int(delay)),
      ])
  pipeline(s_ref.at[b, kvh], v_ref.at[b, kvh])


@functools.partial(jax.jit, static_argnames=("rate", "stages", "pair_hash", "delay",
                                             "interpret"))
def _call(scores, value_states, seeds, *, rate, stages, pair_hash, delay, interpret):
  b, h, sq, skv = scores.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  g = h // kvh
  how = "element" if not pair_hash else "pairs_interpret" if interpret else "pairs"
  kernel = functools.partial(
      _kernel, kvh_count=kvh, g=g, sq=sq, skv=skv, d=d,
      keep_scale=None if rate == 0 else dropout_scale(rate), keep_hash=(h, g, sq, skv, how),
      stages=stages, delay=delay)
  dtype = scores.dtype
  like = (scores, value_states)
  o, p, o32 = plgpu.kernel(
      kernel,
      out_type=(out_struct((b, sq, h, d), dtype, *like),
                out_struct((b, kvh, g * sq, skv), dtype, *like),
                out_struct((b, sq, h, d), f32, *like)),
      scratch_types=[plgpu.SMEM((WGS, 2, ROWS, KEYS), dtype, transforms=_mosaic.tiled(dtype)),
                     plgpu.SMEM((WGS, 2, ROWS, KEYS), dtype, transforms=_mosaic.tiled(dtype)),
                     plgpu.SMEM((WGS, ROWS, d), dtype, transforms=_mosaic.tiled(dtype))],
      grid=(b * kvh, g * sq // (WGS * ROWS)), grid_names=("bk", "rows"),
      num_threads=WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_mosaic.interpret_params(interpret),
  )(scores.reshape(b, kvh, g * sq, skv), value_states, seeds)
  o, p, o32 = _mosaic.varying_like((o, p, o32), *like)
  return o, p.reshape(b, h, sq, skv), o32


def forward_with_output(scores, value_states, dropout_rate, dropout_rng=None, *, stages=3,
                        pair_hash=True, delay=True, interpret=False):
  """``(O [B, Sq, H, D], P [B, H, Sq, Skv], O_f32 [B, Sq, H, D])`` of op A's forward, the
  keep mask that of ``jax_ops.dropout_keep_mask(dropout_rng, dropout_rate, scores.shape)``
  (not stored). ``scores`` ``[B, H, Sq, Skv]`` bf16 or fp16, ``value_states`` ``[B, KVH,
  Skv, D]``, ``dropout_rate`` a Python float in [0, 1) (rounded as the mask rounds it).
  ``stages``: the TMA ring's depth; ``pair_hash``: one hash per pair of columns (else per
  element); ``delay``: each step's P·V GEMM waited for in the next step (needs
  ``stages >= 3``). Raises ``ValueError`` for a problem outside :func:`unsupported_reason`,
  and off a Hopper GPU unless ``interpret``."""
  from pallas_kernels import _dropout, validation
  p = validation.check_dropout_rate("dropout_rate", dropout_rate)
  if scores.ndim != 4 or value_states.ndim != 4:
    raise ValueError(f"scores [B, H, Sq, Skv] and value_states [B, KVH, Skv, D]: got ranks "
                     f"{scores.ndim} and {value_states.ndim}")
  b, h, sq, skv = scores.shape
  kvh, d = value_states.shape[1], value_states.shape[3]
  validation.check_array("value_states", value_states, ("B", "KVH", "Skv", "D"),
                         (b, None, skv, None), dtypes=(scores.dtype,))
  if h % kvh:
    raise ValueError(f"value_states: {kvh} kv heads must divide the scores' {h} heads")
  why = unsupported_reason(b, h, kvh, sq, skv, d, scores.dtype, p)
  if why:
    raise ValueError(f"attention_softmax_dropout_value forward (mosaic_gpu): {why}")
  _mosaic.check_hopper("attention_softmax_dropout_value forward", interpret, scores,
                       value_states)
  if p == 0:
    seeds = jnp.zeros((4,), jnp.uint32)
    rate = 0.0
  else:
    seeds = _mg.keep_seeds_of(dropout_rng, p)
    rate = _dropout.effective_rate(p)
  if isinstance(stages, bool) or not isinstance(stages, int) or not 2 <= stages <= 8:
    raise ValueError(f"stages: expected an int in [2, 8], got {stages!r}")
  if delay and stages < 3:
    raise ValueError(f"delay: needs stages >= 3, got stages={stages}")
  return _call(scores, value_states, seeds, rate=rate, stages=stages, pair_hash=pair_hash,
               delay=delay, interpret=interpret)
