"""The qk_scale_softmax forward as one Pallas Mosaic GPU kernel (Hopper, sm_90a):
``P = softmax((Q @ K^T) * scaling)``, dense rows, ``Q @ K^T`` on the tensor cores (wgmma).

The Triton forward's math (:mod:`pallas_kernels.qk_scale_softmax.forward`), with ``1 / l`` folded
into the exponent::

    s = Q @ K^T                               (fp32 accumulation)
    m = max_k s * c,  l = sum_k exp2(s * c - m)       with c = scaling * log2(e)
    P = exp2(s * c - (m + log2(l)))           rounded to the input dtype

A program owns 128 query rows of one (batch, head), 64 per consumer warpgroup, their Q rows
resident in shared memory, and runs one warp-specialized pipeline of ``2 * seq_k / keys``
steps: a TMA warpgroup streams the head's ``[keys, D]`` tiles of K twice (the second time
mostly from L2). At each step a consumer warpgroup issues the wgmma of its ``[64, keys]``
logits tile and, while it runs, works on the previous step's tile:

1. (a tile of the first ``seq_k / keys`` steps) the running row max and sum (rescaled when
   the max grows); after the last one the max becomes ``m + log2(l)``;
2. (a tile of the rest) ``P = exp2(s * c - m)``, stored through shared memory with TMA (two
   staging tiles per warpgroup: a tile is overwritten once its last copy has read it).

The last tile's ``P`` is stored after the pipeline.

Bytes: Q and K in, P out once (2 B per element in bf16). ``Q @ K^T`` is computed twice, as
in the Triton forward. Supported (:func:`unsupported_reason`): bf16 or fp16, ``D`` of 64 or
128, ``seq_q % 128 == 0``, ``seq_k % 64 == 0``, dense (causal calls take the Triton forward,
which skips the tiles above the diagonal), a static scale.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _mosaic, validation
from pallas_kernels._util import out_struct

f32 = jnp.float32
i32 = np.int32
ROWS = 64            # query rows per consumer warpgroup (one wgmma M)
WGS = 2              # consumer warpgroups
ROW_BLOCK = WGS * ROWS
LOG2E = math.log2(math.e)


def default_keys(seq_k: int) -> int:
  """Keys per step: 128 where they divide ``seq_k``, else 64."""
  return 128 if seq_k % 128 == 0 else 64


def unsupported_reason(b, h, sq, sk, d, dtype, scaling_static, causal=False) -> str | None:
  """Why this kernel cannot run a problem (``None``: it can); ``scaling_static`` the scale as
  a float, ``None`` when traced."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype)} (bfloat16 or float16 only)"
  if d not in (64, 128):
    return f"head dim {d} (query.shape[3]: 64 or 128 only)"
  if sq % ROW_BLOCK:
    return f"seq_q {sq} (query.shape[2]: a multiple of {ROW_BLOCK} only)"
  if sk % 64:
    return f"seq_k {sk} (key.shape[2]: a multiple of 64 only)"
  if causal:
    return "a causal mask (dense rows only; the Triton forward skips the masked tiles)"
  if scaling_static is None:
    return "a traced scaling (static scales only)"
  if b * h * sq * sk >= 2 ** 31:
    return f"{b * h * sq * sk} elements of P (fewer than 2**31 only)"
  return None


def _rows(x, shape):
  return lax.broadcast_in_dim(x, shape, [0])


def _kernel(q_ref, k_ref, p_ref, q_smem, q_barrier, p_stage, *, sk, keys, stages, c):
  bh = lax.axis_index("bh")
  rb = lax.axis_index("rows")
  wg = lax.axis_index("wg")
  n_k = sk // keys
  row0 = rb * ROW_BLOCK + wg * ROWS
  dtype = p_ref.dtype

  def stats(s, m, l):
    m_new = jnp.maximum(m, jnp.max(s, axis=1) * c)
    e = jnp.exp2(s * c - _rows(m_new, s.shape))
    return m_new, l * jnp.exp2(m - m_new) + jnp.sum(e, axis=1)

  def unchanged(s, m, l):
    del s
    return m, l

  def store(s, m_log_l, jj):
    """P's key tile ``jj`` from its logits ``s``, out through staging slot ``jj % 2``."""
    slot = lax.rem(jj, i32(2))
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # the slot's last copy has read it
    p_stage[wg, slot] = jnp.exp2(s * c - _rows(m_log_l, s.shape)).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
        p_stage.at[wg, slot], p_ref.at[bh, pl.ds(row0, ROWS), pl.ds(jj * keys, keys)])

  def compute_context(run_pipeline):
    plgpu.copy_gmem_to_smem(q_ref.at[bh, pl.ds(row0, ROWS)], q_smem.at[wg], q_barrier.at[wg])
    plgpu.barrier_wait(q_barrier.at[wg])
    m = jnp.full((ROWS,), -jnp.inf, f32)
    l = jnp.zeros((ROWS,), f32)
    s = plgpu.layout_cast(jnp.zeros((ROWS, keys), f32), plgpu.Layout.WGMMA)
    m, _, s = run_pipeline((m, l, s))
    store(s, m, i32(n_k - 1))
    plgpu.wait_smem_to_gmem(0)

  def step(idx, k_smem, carry):
    (j,) = idx
    m, l, s_prev = carry
    jp = j - 1                      # the step whose logits s_prev holds

    def mm(acc):
      plgpu.wgmma(acc, q_smem.at[wg], k_smem.T)
      # The previous tile's softmax runs while this tile's wgmma is in flight.
      m2, l2 = lax.cond(jnp.logical_and(jp >= 0, jp < n_k), stats, unchanged, s_prev, m, l)
      m2 = lax.cond(jp == n_k - 1, lambda: m2 + jnp.log2(l2), lambda: m2)

      @pl.when(jp >= n_k)
      def _store():
        store(s_prev, m2, jp - n_k)
      plgpu.wgmma_wait(0)
      return acc[...], m2, l2
    s, m, l = pl.run_scoped(mm, plgpu.ACC((ROWS, keys), f32))
    return m, l, s

  tiled = _mosaic.tiled(p_ref.dtype)
  pipeline = plgpu.emit_pipeline_warp_specialized(
      step, grid=(2 * n_k,), max_concurrent_steps=stages,
      memory_registers=_mosaic.MEMORY_REGISTERS, num_compute_wgs=WGS, wg_axis="wg",
      compute_context=compute_context,
      in_specs=[plgpu.BlockSpec((keys, k_ref.shape[-1]), lambda j: (lax.rem(j, i32(n_k)), 0),
                                transforms=tiled)])
  pipeline(k_ref.at[bh])


@functools.partial(jax.jit, static_argnames=("scale", "keys", "stages", "interpret"))
def _call(query, key, *, scale, keys, stages, interpret):
  b, h, sq, d = query.shape
  sk = key.shape[2]
  bh = b * h
  dtype = query.dtype
  tiled = _mosaic.tiled(dtype)
  kernel = functools.partial(_kernel, sk=sk, keys=keys, stages=stages, c=scale * LOG2E)
  like = (query, key)
  probs = plgpu.kernel(
      kernel,
      out_type=out_struct((bh, sq, sk), dtype, *like),
      scratch_types=[plgpu.SMEM((WGS, ROWS, d), dtype, transforms=tiled),
                     plgpu.Barrier(num_barriers=WGS),
                     plgpu.SMEM((WGS, 2, ROWS, keys), dtype, transforms=tiled)],
      grid=(bh, sq // ROW_BLOCK), grid_names=("bh", "rows"),
      num_threads=WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_mosaic.interpret_params(interpret),
  )(query.reshape(bh, sq, d), key.reshape(bh, sk, d))
  probs = _mosaic.varying_like(probs, *like)
  return probs.reshape(b, h, sq, sk)


def qk_scale_softmax_forward(query, key, scaling, causal: bool = False, *, keys=None,
                             stages=4, interpret=False):
  """``P = softmax((Q @ K^T) * scaling)`` ``[B, H, Sq, Sk]`` in the inputs' dtype, one Mosaic
  GPU kernel.

  ``query`` ``[B, H, Sq, D]``, ``key`` ``[B, H, Sk, D]``, bf16 or fp16; ``scaling`` a Python
  float > 0. ``keys``: keys per pipeline step (64 or 128 dividing ``Sk``; ``None``:
  :func:`default_keys`); ``stages``: the TMA ring's depth (2-8). Raises ``ValueError`` for
  a problem outside :func:`unsupported_reason` (a causal call among them), and off a Hopper
  GPU unless ``interpret``."""
  validation.check_array("query", query, ("B", "H", "Sq", "D"),
                         dtypes=(jnp.bfloat16, jnp.float16, jnp.float32))
  b, h, sq, d = query.shape
  validation.check_array("key", key, ("B", "H", "Sk", "D"), (b, h, None, d),
                         dtypes=(query.dtype,))
  sk = key.shape[2]
  scale = validation.check_scaling("scaling", scaling)
  why = unsupported_reason(b, h, sq, sk, d, query.dtype, scale, bool(causal))
  if why:
    raise ValueError(f"qk_scale_softmax forward (mosaic_gpu): {why}")
  if keys is None:
    keys = default_keys(sk)
  if keys not in (64, 128) or sk % keys:
    raise ValueError(f"keys: expected 64 or 128 dividing seq_k {sk}, got {keys!r}")
  if isinstance(stages, bool) or not isinstance(stages, int) or not 2 <= stages <= 8:
    raise ValueError(f"stages: expected an int in [2, 8], got {stages!r}")
  _mosaic.check_hopper("qk_scale_softmax forward", interpret, query, key)
  return _call(query, key, scale=float(scale), keys=int(keys), stages=stages,
               interpret=interpret)
