"""Masked softmax -> dropout backward (problem B), a Pallas Triton kernel.

Forward (for context): ``P = softmax(scores.masked_fill(~mask, -1e4))``,
``y = P * keep / (1 - p)``. Backward, all fp32 inside::

    gd = g * keep / (1 - p)        (gd = g when p == 0; keep is then not read)
    s  = rowsum(P * gd)            (over all columns: the mask is not applied)
    dS = where(mask, P * (gd - s), 0)

Design: the op is a row-wise reduction followed by an elementwise update, so
one program owns ``block_rows`` whole rows of one head (the row is padded to a
power of two and masked) and reads g, P, keep and the mask exactly once; the
result is written once. That is the minimum traffic: 4 + 4 (+1 keep) bytes in,
4 out per element, plus the [B, 1, Sq, Sk] attention mask. The launch grid is
(heads, batch * row blocks) with heads fastest, so the H programs that share a
mask tile run together and the mask comes from L2 after its first read.
``block_rows`` is chosen so each program moves a few thousand elements: small
rows get many rows per program (fewer, fuller programs), long rows get one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _checks
from pallas_kernels._util import cdiv, compiler_params, next_power_of_2, pallas_call


def default_config(sq: int, sk: int) -> tuple[int, int]:
  """``(block_rows, num_warps)`` for rows of length ``sk``: about 4096 elements a program."""
  block_cols = next_power_of_2(sk)
  block_rows = max(1, min(4096 // block_cols, next_power_of_2(sq)))
  elems = block_rows * block_cols
  num_warps = 4 if elems <= 2048 else 8 if elems <= 8192 else 16
  return block_rows, num_warps


def _kernel(*refs, num_heads, n_rows, n_cols, block_rows, block_cols, dropout):
  if dropout == "dynamic":
    scale_ref, g_ref, p_ref, mask_ref, keep_ref, o_ref = refs
  elif dropout == "none":
    g_ref, p_ref, mask_ref, o_ref = refs
  else:
    g_ref, p_ref, mask_ref, keep_ref, o_ref = refs
  h = pl.program_id(0)
  n_row_blocks = cdiv(n_rows, block_rows)
  t = pl.program_id(1)
  b = t // n_row_blocks
  r0 = (t % n_row_blocks) * block_rows
  rows = r0 + jnp.arange(block_rows)
  cols = jnp.arange(block_cols)
  valid = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
  tile = (b * num_heads + h, pl.ds(r0, block_rows), pl.ds(0, block_cols))

  def load(ref, other, **kw):
    return pltriton.load(ref.at[tile], mask=valid, other=other, **kw)

  g = load(g_ref, 0.0, eviction_policy="evict_first").astype(jnp.float32)
  probs = load(p_ref, 0.0, eviction_policy="evict_first").astype(jnp.float32)
  if dropout == "none":
    gd = g
  elif dropout == "dynamic":
    # A traced rate: when it is 0 the predicated-off load never touches memory.
    scale = scale_ref[0]
    read_keep = valid & (scale_ref[1] > 0)
    keep = pltriton.load(keep_ref.at[tile], mask=read_keep, other=True,
                         eviction_policy="evict_first")
    gd = jnp.where(keep, g * scale, 0.0)
  else:
    keep = load(keep_ref, False, eviction_policy="evict_first")
    gd = jnp.where(keep, g * dropout, 0.0)
  s = jnp.sum(probs * gd, axis=1, keepdims=True)
  attend = pltriton.load(mask_ref.at[b, pl.ds(r0, block_rows), pl.ds(0, block_cols)],
                         mask=valid, other=False, eviction_policy="evict_last")
  out = jnp.where(attend, probs * (gd - s), 0.0)
  pltriton.store(o_ref.at[tile], out.astype(o_ref.dtype), mask=valid)


@functools.partial(jax.jit, static_argnames=("p_static", "block_rows", "num_warps",
                                             "num_stages", "interpret"))
def _call(grad_output, p_attn, mask, dropout_mask, p_dropout, *, p_static, block_rows,
          num_warps, num_stages, interpret):
  b, h, sq, sk = p_attn.shape
  block_cols = next_power_of_2(sk)
  if p_static is None:
    dropout = "dynamic"
  elif p_static == 0.0:
    dropout = "none"
  else:
    dropout = 1.0 / (1.0 - p_static)
  kernel = functools.partial(_kernel, num_heads=h, n_rows=sq, n_cols=sk,
                             block_rows=block_rows, block_cols=block_cols, dropout=dropout)
  args = [grad_output.reshape(b * h, sq, sk), p_attn.reshape(b * h, sq, sk),
          mask.reshape(b, sq, sk)]
  if dropout == "dynamic":
    p = jnp.asarray(p_dropout, jnp.float32)
    args.insert(0, jnp.stack([1.0 / (1.0 - p), (p > 0).astype(jnp.float32)]))
  if dropout != "none":
    args.append(dropout_mask.reshape(b * h, sq, sk))
  out = pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((b * h, sq, sk), p_attn.dtype),
      grid=(h, b * cdiv(sq, block_rows)),
      compiler_params=compiler_params(num_warps, num_stages),
      interpret=interpret,
      name="masked_softmax_dropout_backward",
  )(*args)
  return out.reshape(b, h, sq, sk)


def masked_softmax_dropout_backward(grad_output, p_attn, mask, dropout_mask, p_dropout, *,
                                    block_rows: int | None = None, num_warps: int | None = None,
                                    num_stages: int = 1, interpret: bool = False):
  """Gradient of the scores through masked softmax and dropout.

  Args:
    grad_output: ``[B, H, Sq, Sk]`` float (fp32 in the usual case), gradient of
      the dropout output.
    p_attn: ``[B, H, Sq, Sk]``, same dtype, the softmax output P.
    mask: ``[B, 1, Sq, Sk]`` bool, True = attend; broadcast over the heads.
    dropout_mask: ``[B, H, Sq, Sk]`` bool, True = kept. Never read when the rate
      is 0 (it may then be ``None`` if the rate is a Python number).
    p_dropout: dropout rate in [0, 1): a Python float, or a traced scalar.
    block_rows: rows per program (power of two); default from the shape.
    num_warps, num_stages: Triton launch parameters.
    interpret: run the kernel in the Pallas interpreter (any backend).

  Returns:
    ``grad_scores [B, H, Sq, Sk]`` in the dtype of ``p_attn``.
  """
  p = _checks.check_problem_b(grad_output, p_attn, mask, dropout_mask, p_dropout)
  default_rows, default_warps = default_config(p_attn.shape[2], p_attn.shape[3])
  if block_rows is not None and (block_rows < 1 or block_rows & (block_rows - 1)):
    raise ValueError(f"block_rows: expected a power of two, got {block_rows}")
  return _call(grad_output, p_attn, mask, dropout_mask, p_dropout, p_static=p,
               block_rows=block_rows or default_rows, num_warps=num_warps or default_warps,
               num_stages=num_stages, interpret=interpret)
