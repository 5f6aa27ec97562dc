"""Pallas Triton kernels for the backward of ``softmax((Q @ K^T) * scaling)``: the entry point.

Given the softmax output ``P`` and its incoming gradient ``g`` (both ``[B, H, Sq, Sk]``),
the gradients of ``Q`` (``[B, H, Sq, D]``) and ``K`` (``[B, H, Sk, D]``) are::

  delta_i    = sum_j g_ij * P_ij                            (fp32)
  dL_ij      = dtype(dtype(P_ij * (g_ij - delta_i)) * scaling)
  grad_query = dL @ K
  grad_key   = dL^T @ Q

``delta`` is a full-row reduction that every ``dL`` element needs, and ``dL`` is rounded
exactly as the reference rounds it. With ``renormalize=True`` a row of P whose sum is within
``2**-6`` of 1 is first corrected to sum to 1, ``P' = P (1 + r P)``, and ``dL = dtype(P' (g -
sum_j g_ij P'_ij) * scaling)`` is rounded once (``_common``): the gradient keeps ``g - delta``
on a sharp row, where ``P_ii`` rounds to 1. The config (:func:`.config.default_config`) picks
one of three schemes: ``"two_pass"`` (:mod:`.two_pass`: a row kernel for ``delta`` and
``grad_query``, a column kernel for ``grad_key``), ``"per_head"`` (:mod:`.per_head`: one
program per head, short rows) and ``"dl_gemm"`` (:mod:`.dl_gemm`: ``dL`` written, then the two
GEMMs in one launch). Causal (``causal=True``): the caller promises ``P_ij = 0`` for ``j > i +
(Sk - Sq)``, and tiles wholly above that diagonal are skipped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _tuning, validation
from pallas_kernels._util import check_can_compile
from pallas_kernels.qk_scale_softmax import dl_gemm, per_head, two_pass
from pallas_kernels.qk_scale_softmax._common import F32, SUPPORTED
from pallas_kernels.qk_scale_softmax.config import (MAX_DL_ELEMENTS, MAX_DL_ROW, Config,
                                                    DlConfig, default_config,
                                                    default_dl_config, dl_width)

__all__ = ["qk_scale_softmax_backward"]


def _check_dl_gemm(cfg: DlConfig, query, key):
  """The ``"dl_gemm"`` scheme's limits: whole rows in registers, 16-bit inputs, ``D <= 128``."""
  seq_k = key.shape[2]
  width = dl_width(seq_k)
  if width > MAX_DL_ROW:
    raise ValueError(f"config.scheme: 'dl_gemm' holds whole rows in registers, rows of at "
                     f"most {MAX_DL_ROW} keys; got key of shape {key.shape}")
  if cfg.rows * width > MAX_DL_ELEMENTS:
    raise ValueError(f"config.dl.rows: {cfg.rows} rows of {width} (padded) keys exceed "
                     f"the {MAX_DL_ELEMENTS} elements a dL program may hold; use rows <= "
                     f"{max(1, MAX_DL_ELEMENTS // width)}")
  if not dl_gemm.takes(query.dtype, query.shape[3]):
    raise ValueError(f"config.scheme: 'dl_gemm' takes 16-bit inputs with D <= 128; got "
                     f"{query.dtype} query of shape {query.shape}")


@functools.partial(jax.jit, static_argnames=("causal", "config", "interpret", "renormalize"))
def _backward(grad_output, query, key, attn_weights, scaling, *, causal, config, interpret,
              renormalize):
  b, h, seq_q, head_dim = query.shape
  seq_k = key.shape[2]
  bh = b * h
  # Free reshapes to [B*H, ...] views; the kernels index every dimension separately.
  g = grad_output.reshape(bh, seq_q, seq_k)
  p = attn_weights.reshape(bh, seq_q, seq_k)
  q = query.reshape(bh, seq_q, head_dim)
  k = key.reshape(bh, seq_k, head_dim)
  scale = jnp.asarray(scaling, F32).reshape(1)
  if config.scheme == "dl_gemm":
    dl_cfg = config.dl or default_dl_config(seq_k)
    grad_query, grad_key = dl_gemm.dl_gemm(scale, g, p, q, k, causal=causal, cfg=dl_cfg,
                                           interpret=interpret, renormalize=renormalize)
  elif config.scheme == "per_head":
    grad_query, grad_key = per_head.head_pass(scale, g, p, q, k, causal=causal,
                                              cfg=config.col, interpret=interpret,
                                              renormalize=renormalize)
  else:
    grad_query, stats = two_pass.row_pass(scale, g, p, k, causal=causal, cfg=config.row,
                                          interpret=interpret, renormalize=renormalize)
    grad_key = two_pass.col_pass(scale, g, p, q, stats, causal=causal, cfg=config.col,
                                 interpret=interpret)
  return grad_query.reshape(b, h, seq_q, head_dim), grad_key.reshape(b, h, seq_k, head_dim)


def qk_scale_softmax_backward(grad_output, query, key, attn_weights, scaling, *, causal=False,
                              config: Config | None = None, block_q=None, block_k=None,
                              num_warps=None, num_stages=None, renormalize=False,
                              interpret=False):
  """Backward of ``softmax((Q @ K^T) * scaling)`` to ``Q`` and ``K``.

  Args:
    grad_output: ``[B, H, Sq, Sk]`` gradient ``g`` of the attention weights.
    query: ``[B, H, Sq, D]``.
    key: ``[B, H, Sk, D]``.
    attn_weights: ``[B, H, Sq, Sk]`` softmax output ``P``.
    scaling: the logits' scale; a Python float or a (possibly traced) scalar.
    causal: the caller promises ``P_ij == 0`` for ``j > i + (Sk - Sq)``; tiles entirely in
      that region are skipped (never loaded, no MMAs). Results equal the dense ones.
    config: the scheme and each kernel's tiles and launch parameters (:class:`Config`).
      Default: the tuned table of the device kind that runs the call (16-bit inputs,
      D <= 128), else a heuristic (:func:`default_config`).
    block_q, block_k, num_warps, num_stages: override one field of both kernels' configs
      (tiles: powers of two >= 16 along ``Sq`` and ``Sk``). With the ``"dl_gemm"`` scheme
      only ``num_warps`` applies (to the ``dL`` kernel); the others raise.
    renormalize: ``False`` (the spec's ``dL``, rounded twice) or ``True`` (rows of P whose
      sum is within ``2**-6`` of 1 corrected to sum to 1, ``dL`` rounded once: the op's
      backward, accurate on sharp rows; three more row sums, same bytes).
    interpret: run the kernels in the Pallas interpreter (any backend; slow, for tests).
      Without it the kernels compile for a CUDA GPU only.

  All arrays share one dtype: bfloat16 (main target), float16 or float32. Arithmetic is fp32
  with ``dL`` rounded to the input dtype exactly as the reference; matmuls take ``dL`` and
  ``K``/``Q`` in the input dtype (tensor cores) and accumulate in fp32. ``D`` may be any size
  (padded to a power of two >= 16 and masked); ``Sq``/``Sk`` any length >= 1.

  Design (module docstring): ``"per_head"`` (``g`` and ``P`` read once, 4 B per element in
  bf16), ``"two_pass"`` (8-12 B per element) or ``"dl_gemm"`` (10 B per element and a ``dL``
  buffer the size of ``P``), as the config names.

  Returns:
    ``(grad_query [B, H, Sq, D], grad_key [B, H, Sk, D])`` in the inputs' dtype.
  """
  check_can_compile("qk_scale_softmax_backward", interpret, grad_output, query, key,
                    attn_weights)
  validation.check_qk_scale_softmax(grad_output, query, key, attn_weights, scaling,
                                    dtypes=SUPPORTED)
  causal = validation.check_causal(causal, query.shape[2], key.shape[2], every_row_has_keys=False)
  if config is not None and not isinstance(config, Config):
    raise TypeError(f"config: expected a qk_scale_softmax.Config, got {type(config).__name__}")
  if config is None:
    device_kind = _tuning.device_kind_of(grad_output, query, key, attn_weights,
                                         interpret=interpret)
    config = default_config(query.shape[2], key.shape[2], query.shape[3], query.dtype,
                            device_kind, causal=causal)
  if config.scheme == "dl_gemm":
    given = [n for n, v in (("block_q", block_q), ("block_k", block_k),
                            ("num_stages", num_stages)) if v is not None]
    if given:
      raise ValueError(f"{', '.join(given)}: the 'dl_gemm' scheme's dL kernel takes whole "
                       f"rows (set config.dl = DlConfig(rows=..., num_warps=...) instead, "
                       f"and DlConfig(gemm=PassConfig(...)) for its GEMM launch's tiles)")
    config = dataclasses.replace(config, dl=config.dl or default_dl_config(key.shape[2]))
    _check_dl_gemm(config.dl, query, key)
  config = _tuning.with_overrides(config, block_q=block_q, block_k=block_k,
                                  num_warps=num_warps, num_stages=num_stages)
  return _backward(grad_output, query, key, attn_weights, scaling, causal=causal,
                   config=config, interpret=bool(interpret), renormalize=bool(renormalize))
