"""The qk_scale_softmax forward in one Pallas Triton kernel: ``P = softmax((Q @ K^T) * scaling)``.

As the jnp forward (``jax_ops.ops.qk_scale_softmax.reference.qk_scale_softmax_forward``) computes it::

    logits = (Q @ K^T) * scaling        # fp32 accumulation, input-dtype operands
    logits = -inf above the diagonal     # causal: keys k > q + (Sk - Sq)
    P      = softmax(logits) in fp32, rounded to the input dtype       # [B, H, Sq, Sk]

One program owns ``block_q`` query rows of one (batch, head); its ``Q`` rows stay in
registers. Rows of one key tile (``Sk <= block_k``) take one GEMM and the softmax from
registers. Longer rows take two passes: pass 1 walks the key tiles (``block_k`` keys each):
``s = Q @ K_j^T`` on the tensor cores, then the running row max and the running sum of
``exp(s * scaling - max)`` in fp32 (rescaled when the max grows). Pass 2 computes the same
tiles again and stores ``P = exp(s * scaling - m) * (1 / l)`` rounded to the input dtype. The logits never reach memory:
the kernel reads ``Q`` and ``K`` and writes ``P`` once (2 B per element in bf16), at the cost
of computing ``Q @ K^T`` twice. A causal call skips the GEMMs and the exponentials of the key
tiles wholly above the diagonal and stores zeros there; only the tiles that cross the diagonal
apply an element-wise mask.

``P`` matches the jnp softmax to within its rounding, not bit for bit: the row sum is
accumulated in another order (online), so the fp32 ``P`` differs by a few fp32 ulps and the
rounded ``P`` by one ulp of the input dtype in a small fraction of the elements (the tests
bound both).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import _triton_tiles as tiles
from pallas_kernels import _tuning, _util, validation
from pallas_kernels._util import compiler_params, dot, next_power_of_2, out_struct, pallas_call
from pallas_kernels.qk_scale_softmax._common import row_num_full_k_tiles, row_num_k_tiles
from pallas_kernels.qk_scale_softmax.config import KERNEL, length_class

__all__ = ["qk_scale_softmax_forward", "ForwardConfig", "default_forward_config",
           "forward_config", "takes"]

_NAME = "qk_scale_softmax_forward"
_F32 = jnp.float32
_FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class ForwardConfig(_tuning.TritonPassConfig):
  """The forward kernel's tiles and launch: ``block_q`` query rows per program, ``block_k``
  keys per tile (powers of two >= 16), Triton's ``num_warps`` and
  ``num_stages``.

  Key tiles of more than 256 keys are refused: a 64 x 512 tile (one GEMM of N = 512)
  miscompiles on Hopper (a wrong P)."""
  block_q: int = 128
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):
    super().__post_init__()  # validates the fields (ValueError naming the field)
    if self.block_k > 256:
      raise ValueError(f"config.block_k: expected at most 256, got {self.block_k} (wider key "
                       "tiles miscompile on Hopper)")


def default_forward_config(seq_q: int, seq_k: int, head_dim: int,
                           dtype=jnp.bfloat16) -> ForwardConfig:
  """The default config, its tiles capped at the padded lengths (>= 16).

  Rows of at most 256 keys take them as one tile (one GEMM, no second pass): 64 rows on 4
  warps up to 128 keys, on 8 warps at 256. Longer rows: 128 rows by 64 keys on 8 warps, 3
  stages.

  Rows of a head wider than 256 bytes (bf16 D > 128, fp32 D > 64; untuned) take smaller
  tiles, so that the K tiles and Q fit in shared memory and registers: two passes of 64 x 64
  tiles on 2 stages up to 512 bytes, of 32 x 32 tiles on 1 stage beyond."""
  width = tiles.padded_head_dim(head_dim) * jnp.dtype(dtype).itemsize
  rows = max(16, next_power_of_2(seq_q))
  if width > 512:
    return ForwardConfig(block_q=min(32, rows), block_k=min(32, max(16, next_power_of_2(seq_k))),
                         num_warps=4, num_stages=1)
  if width > 256:
    return ForwardConfig(block_q=min(64, rows), block_k=min(64, max(16, next_power_of_2(seq_k))),
                         num_warps=4, num_stages=2)
  if seq_k <= 256:
    block_k = max(16, next_power_of_2(seq_k))
    return ForwardConfig(block_q=min(64, rows), block_k=block_k,
                         num_warps=4 if block_k <= 128 else 8, num_stages=2)
  return ForwardConfig(block_q=min(128, rows), block_k=64, num_warps=8, num_stages=3)


def forward_config(seq_q: int, seq_k: int, head_dim: int, dtype,
                   device_kind: str | None = None) -> ForwardConfig:
  """The tuned launch for rows of ``seq_k`` keys on ``device_kind``: the ``"fwd"`` entry of
  their length class in the device's ``qk_scale_softmax`` table (16-bit inputs with
  ``head_dim <= 128``, the problems the tuner times), its tiles capped at the padded lengths;
  else :func:`default_forward_config` (also for ``device_kind`` ``None``)."""
  fields = _tuning.forward_entry(KERNEL, device_kind, length_class(seq_k), dtype, head_dim)
  if fields is None:
    return default_forward_config(seq_q, seq_k, head_dim, dtype)
  return ForwardConfig(**fields).capped(seq_q, seq_k)


def _kernel(scale_ref, q_ref, k_ref, p_ref, *, seq_q, seq_k, head_dim, d_pad, block_q, block_k,
            causal):
  """Refs: scale [1] fp32 (``scaling * log2(e)``), Q [B*H, Sq, D], K [B*H, Sk, D] -> P
  [B*H, Sq, Sk]."""
  qi = pl.program_id(0)   # row block: the fastest grid axis (programs share a head's K in L2)
  bh = pl.program_id(1)
  q0 = qi * block_q
  rows = q0 + jnp.arange(block_q, dtype=jnp.int32)
  q_mask = tiles.tail_mask(q0, block_q, seq_q)
  d_mask = tiles.dim_mask(d_pad, head_dim)
  dims = tiles.head_dims(d_pad)
  scale = scale_ref[0]
  q = tiles.load(q_ref.at[bh, pl.ds(q0, block_q), dims], tiles.outer(q_mask, d_mask), 0.0)
  n_k = pl.cdiv(seq_k, block_k)
  ragged_k = seq_k % block_k != 0
  if causal:
    n_tiles = row_num_k_tiles(qi, seq_q, seq_k, block_q, block_k)
    n_full = row_num_full_k_tiles(qi, seq_q, seq_k, block_q, block_k)
  else:
    n_tiles = n_full = n_k

  def tile(j):
    k0 = j * block_k
    cols = k0 + jnp.arange(block_k, dtype=jnp.int32)
    k_mask = tiles.tail_mask(k0, block_k, seq_k)
    return cols, k_mask, (bh, pl.ds(q0, block_q), tiles.ds(k0, block_k))

  def logits(j, diagonal):
    """Key tile ``j`` of ``scaling * log2(e) * Q @ K^T`` in fp32; keys past ``seq_k`` (and,
    with ``diagonal``, above the causal diagonal) are ``-inf``."""
    cols, k_mask, _ = tile(j)
    k = tiles.load(k_ref.at[bh, tiles.ds(j * block_k, block_k), dims], tiles.outer(k_mask, d_mask), 0.0)
    s = dot(q, k, trans_b=True) * scale
    valid = None
    if ragged_k:
      valid = k_mask[None, :]
    if diagonal:
      below = cols[None, :] <= rows[:, None] + (seq_k - seq_q)
      valid = below if valid is None else valid & below
    if valid is not None:
      s = jnp.where(valid, s, -jnp.inf)
    return s

  if n_k == 1:
    # Rows of one key tile: one GEMM, the softmax from registers.
    first = np.int32(0)   # int32 under x64 too, like the program ids beside it
    s = logits(first, causal)
    e = jnp.exp2(s - jnp.max(s, axis=1)[:, None])
    probs = e * (1.0 / jnp.sum(e, axis=1))[:, None]
    _, k_mask, idx = tile(first)
    tiles.store(p_ref.at[idx], probs.astype(p_ref.dtype), tiles.outer(q_mask, k_mask))
    return

  # Pass 1: the row max m and the row sum l of exp2(s - m), online. Every row's first tile
  # holds a key it sees (key 0), so m is finite from the first tile on.
  def stats(j, carry, diagonal=False):
    m, l = carry
    s = logits(j, diagonal)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    l = l * jnp.exp2(m - m_new) + jnp.sum(jnp.exp2(s - m_new[:, None]), axis=1)
    return m_new, l

  init = (jnp.full((block_q,), -jnp.inf, _F32), jnp.zeros((block_q,), _F32))
  m, l = tiles.fori_loop(0, n_full, stats, init)
  if causal:
    m, l = tiles.fori_loop(n_full, n_tiles, functools.partial(stats, diagonal=True), (m, l))
  inv_l = (1.0 / l)[:, None]

  # Pass 2: P = exp2(s - m) * (1 / l), rounded and stored.
  def write(j, carry, diagonal=False):
    _, k_mask, idx = tile(j)
    probs = jnp.exp2(logits(j, diagonal) - m[:, None]) * inv_l
    tiles.store(p_ref.at[idx], probs.astype(p_ref.dtype), tiles.outer(q_mask, k_mask))
    return carry

  tiles.fori_loop(0, n_full, write, 0)
  if causal:
    tiles.fori_loop(n_full, n_tiles, functools.partial(write, diagonal=True), 0)

    def zeros(j, carry):
      _, k_mask, idx = tile(j)
      tiles.store(p_ref.at[idx], jnp.zeros((block_q, block_k), p_ref.dtype), tiles.outer(q_mask, k_mask))
      return carry

    tiles.fori_loop(n_tiles, n_k, zeros, 0)


def takes(b, h, seq_q, seq_k, head_dim) -> bool:
  """Whether the kernel takes a problem of these sizes: its int32 offsets reach every element
  of P, Q and K (fewer than ``2**31`` each)."""
  return max(b * h * seq_q * seq_k, b * h * max(seq_q, seq_k) * head_dim) < 2**31


@functools.partial(jax.jit, static_argnames=("causal", "config", "interpret"))
def _call(query, key, scale, *, causal, config, interpret):
  b, h, seq_q, d = query.shape
  seq_k = key.shape[2]
  kernel = functools.partial(
      _kernel, seq_q=seq_q, seq_k=seq_k, head_dim=d, d_pad=tiles.padded_head_dim(d),
      block_q=config.block_q, block_k=config.block_k, causal=causal)
  args = (scale, query.reshape(b * h, seq_q, d), key.reshape(b * h, seq_k, d))
  probs = pallas_call(
      kernel,
      out_shape=out_struct((b * h, seq_q, seq_k), query.dtype, *args),
      grid=(pl.cdiv(seq_q, config.block_q), b * h),
      compiler_params=compiler_params(config.num_warps, config.num_stages),
      interpret=interpret,
      name=_NAME,
  )(*args)
  return probs.reshape(b, h, seq_q, seq_k)


def qk_scale_softmax_forward(query, key, scaling, causal: bool = False, *,
                             config: ForwardConfig | None = None, interpret: bool = False):
  """``P = softmax((Q @ K^T) * scaling)`` in one kernel (the logits never reach memory).

  Args:
    query: ``[B, H, Sq, D]`` float (bf16 in the usual case; fp16, fp32); any ``D`` (padded
      to a power of two >= 16 and masked), any ``Sq``, ``Sk`` >= 1.
    key: ``[B, H, Sk, D]``, the query's dtype.
    scaling: the logits' scale, a finite number > 0 (a Python float or a traced scalar).
    causal: keys ``k > q + (Sk - Sq)`` get probability exactly 0 (needs ``Sq <= Sk``); the
      kernel skips the GEMMs of the tiles wholly above the diagonal.
    config: tiles and launch (:class:`ForwardConfig`; default :func:`forward_config`: the
      device's tuned table, else :func:`default_forward_config`).
    interpret: run the kernel in the Pallas interpreter (any backend).

  Returns:
    ``P`` ``[B, H, Sq, Sk]`` in the query's dtype (fp32 logits and softmax; matmul operands
    in the input dtype, fp32 accumulation; fp32 inputs multiply in full fp32).
  """
  _util.check_can_compile(_NAME, interpret, query, key)
  validation.check_array("query", query, ("B", "H", "Sq", "D"), dtypes=_FLOATS)
  validation.check_positive("query", query, ("B", "H", "Sq", "D"))
  b, h, seq_q, d = query.shape
  validation.check_array("key", key, ("B", "H", "Sk", "D"), (b, h, None, d),
                         dtypes=(query.dtype,))
  validation.check_positive("key", key, ("B", "H", "Sk", "D"))
  seq_k = key.shape[2]
  causal = validation.check_causal(causal, seq_q, seq_k)
  validation.check_scaling("scaling", scaling)
  if not takes(b, h, seq_q, seq_k, d):
    sizes = {"the output P": b * h * seq_q * seq_k, "query": b * h * seq_q * d,
             "key": b * h * seq_k * d}
    name, n = max(sizes.items(), key=lambda kv: kv[1])
    raise ValueError(f"query, key: every array at most 2**31 - 1 elements (int32 offsets), "
                     f"got {n} in {name} (query {list(query.shape)}, key {list(key.shape)})")
  if config is None:
    config = forward_config(seq_q, seq_k, d, query.dtype,
                            _tuning.device_kind_of(query, key, interpret=interpret))
  elif not isinstance(config, ForwardConfig):
    raise TypeError(f"config: expected a qk_scale_softmax ForwardConfig, got "
                    f"{type(config).__name__}")
  # exp(x) = exp2(x * log2(e)): the scale folds the change of base in.
  scale = (jnp.asarray(scaling, _F32) * jnp.asarray(1.4426950408889634, _F32)).reshape(1)
  return _call(query, key, scale, causal=causal, config=config, interpret=bool(interpret))
