"""Which kernels run the qk_scale_softmax forward and backward, for a device and a shape: the
one place of that rule. The kernel entry points :func:`qk_scale_softmax_backward` and
:func:`qk_scale_softmax_forward` follow it; the op (``jax_ops.ops.qk_scale_softmax``) asks
it too."""

from __future__ import annotations

import jax

from pallas_kernels import validation
from pallas_kernels._util import device_of, is_hopper
from pallas_kernels.qk_scale_softmax import (forward, forward_mosaic_gpu, pallas_mosaic_gpu,
                                             pallas_triton)
from pallas_kernels.qk_scale_softmax._common import SUPPORTED

MOSAIC_GPU = "mosaic_gpu"
TRITON = "triton"
IMPLEMENTATIONS = (MOSAIC_GPU, TRITON)
_TRITON_OPTIONS = ("config", "block_q", "block_k", "num_warps", "num_stages")
# The Mosaic GPU forward's key tiles pay off on rows longer than the Triton forward's one tile.
MOSAIC_FORWARD_MIN_KEYS = 257


def mosaic_gpu_reason(query_shape, key_shape, dtype, scaling_static) -> str | None:
  """What of a problem the Mosaic GPU backward kernel does not take (``None``: it takes it):
  rows of 128 keys, ``D == 128``, ``Sq % 64 == 0``, bf16/fp16, a static scale. A causal P
  takes it too (the kernel computes the masked tiles, which hold zeros)."""
  b, h, sq, d = query_shape
  return pallas_mosaic_gpu.unsupported_reason(b, h, sq, key_shape[2], d, dtype,
                                              scaling_static)


def kernels_for(grad_output, query, key, attn_weights, scaling, *, causal=False,
                interpret=False) -> str:
  """``"mosaic_gpu"`` or ``"triton"``: the backward kernels that ``implementation=None``
  runs. The Mosaic GPU kernel compiled on a Hopper GPU where :func:`mosaic_gpu_reason`
  allows; the Triton kernels otherwise, and always under ``interpret=True`` (name
  ``"mosaic_gpu"`` to run the Mosaic GPU interpreter)."""
  validation.check_qk_scale_softmax(grad_output, query, key, attn_weights, scaling,
                                    dtypes=SUPPORTED)
  return _pick(grad_output, query, key, attn_weights, scaling, interpret=interpret)


def _rank4(*arrays) -> bool:
  return all(getattr(x, "ndim", None) == 4 for x in arrays)


def _static_scale(scaling) -> float | None:
  """The scale as a float when it is a concrete real number, else ``None``."""
  try:
    return validation.concrete_float("scaling", scaling)
  except (TypeError, ValueError):
    return None


def _pick(grad_output, query, key, attn_weights, scaling, *, interpret) -> str:
  """:func:`kernels_for` without the argument checks, which the chosen entry point makes
  (arrays of another rank go to the Triton entry point, whose checks name them)."""
  if interpret or not _rank4(query, key):
    return TRITON
  if not is_hopper(device_of(grad_output, query, key, attn_weights)):
    return TRITON
  why = mosaic_gpu_reason(query.shape, key.shape, query.dtype, _static_scale(scaling))
  return TRITON if why else MOSAIC_GPU


def qk_scale_softmax_backward(
    grad_output: jax.typing.ArrayLike, query: jax.typing.ArrayLike, key: jax.typing.ArrayLike,
    attn_weights: jax.typing.ArrayLike, scaling: float | jax.typing.ArrayLike, *,
    causal: bool = False, implementation: str | None = None, renormalize: bool = False,
    interpret: bool = False, **triton_options) -> tuple[jax.Array, jax.Array]:
  """Backward of ``softmax((Q @ K^T) * scaling)`` to ``Q`` and ``K``: the kernel entry point.

  Args:
    grad_output: ``g`` ``[B, H, Sq, Sk]``, the gradient of the attention weights.
    query: ``[B, H, Sq, D]``.
    key: ``[B, H, Sk, D]``.
    attn_weights: the softmax output ``P`` ``[B, H, Sq, Sk]``.
    scaling: the logits' scale; a Python float, or a traced scalar (Triton).
    causal: the caller promises ``P_ij == 0`` for ``j > i + (Sk - Sq)``; the Triton kernels
      skip the tiles above that diagonal (the Mosaic GPU kernel computes them). Results
      equal the dense ones.
    implementation: ``None`` (:func:`kernels_for`), ``"mosaic_gpu"`` or ``"triton"``.
    renormalize: ``False``, the spec's ``dL``; ``True``, rows of P within ``2**-6`` of
      summing to 1 corrected to sum to 1 and ``dL`` rounded once (the op's backward:
      accurate where a sharp row's ``P_ii`` rounds to 1; same bytes).
    interpret: run in the Pallas interpreter (any machine).
    **triton_options: the Triton entry point's other keywords (``config``, ``block_q``,
      ``block_k``, ``num_warps``, ``num_stages``); they select the Triton kernels.

  All arrays share one dtype: bf16 (the target), fp16, or fp32 (Triton).

  Returns:
    ``(grad_query [B, H, Sq, D], grad_key [B, H, Sk, D])`` in the inputs' dtype.
  """
  unknown = sorted(set(triton_options) - set(_TRITON_OPTIONS))
  if unknown:
    raise TypeError(f"qk_scale_softmax_backward: unexpected keyword arguments {unknown}")
  args = (*validation.as_jax(grad_output, query, key, attn_weights), scaling)
  chosen = sorted(k for k, v in triton_options.items() if v is not None)
  if implementation is None:
    # the chosen entry point checks the arguments
    implementation = TRITON if chosen else _pick(*args, interpret=interpret)
  if implementation == MOSAIC_GPU:
    if chosen:
      raise TypeError(f"implementation='mosaic_gpu' takes no Triton options, got {chosen}")
    return pallas_mosaic_gpu.qk_scale_softmax_backward(*args, causal=causal,
                                                       renormalize=renormalize,
                                                       interpret=interpret)
  if implementation == TRITON:
    return pallas_triton.qk_scale_softmax_backward(*args, causal=causal,
                                                   renormalize=renormalize,
                                                   interpret=interpret, **triton_options)
  raise ValueError(f"implementation: expected None or one of {IMPLEMENTATIONS}, got "
                   f"{implementation!r}")


def forward_kernel_for(query, key, scaling, *, causal=False, interpret=False) -> str | None:
  """The fused forward kernel for a problem: ``"mosaic_gpu"`` compiled on a Hopper GPU for
  the dense problems :func:`forward_mosaic_gpu.unsupported_reason` allows with rows of at
  least :data:`MOSAIC_FORWARD_MIN_KEYS` keys; else ``"triton"`` where its int32 offsets
  reach every element (:func:`forward.takes`); else ``None`` (no Pallas forward)."""
  validation.check_query_and_key(query, key)
  return pick_forward(query, key, scaling, causal=causal, interpret=interpret)


def pick_forward(query, key, scaling, *, causal=False, interpret=False) -> str | None:
  """:func:`forward_kernel_for` without the argument checks (the op has made them at its
  boundary; the chosen entry point makes them); arrays of another rank get ``"triton"``,
  whose entry point's checks name them."""
  if not _rank4(query, key):
    return TRITON
  b, h, seq_q, d = query.shape
  seq_k = key.shape[2]
  if not interpret and seq_k >= MOSAIC_FORWARD_MIN_KEYS and is_hopper(device_of(query, key)):
    scale = scaling if isinstance(scaling, (int, float)) else None
    if forward_mosaic_gpu.unsupported_reason(b, h, seq_q, seq_k, d, query.dtype, scale,
                                             causal) is None:
      return MOSAIC_GPU
  return TRITON if forward.takes(b, h, seq_q, seq_k, d) else None


def qk_scale_softmax_forward(query, key, scaling, *, causal=False, implementation=None,
                             interpret=False):
  """``P = softmax((Q @ K^T) * scaling)`` ``[B, H, Sq, Sk]`` from the fused kernel that
  :func:`forward_kernel_for` picks (``implementation=None``) or the one named
  (``"mosaic_gpu"``, ``"triton"``); the chosen kernel's entry point checks the arguments and
  raises ``ValueError`` for a problem it does not take. ``query`` ``[B, H, Sq, D]`` and
  ``key`` ``[B, H, Sk, D]`` share one dtype: bf16, fp16 or fp32."""
  if implementation is None:
    implementation = pick_forward(query, key, scaling, causal=causal,
                                  interpret=interpret) or TRITON
  if implementation == MOSAIC_GPU:
    return forward_mosaic_gpu.qk_scale_softmax_forward(query, key, scaling, causal,
                                                       interpret=interpret)
  if implementation == TRITON:
    return forward.qk_scale_softmax_forward(query, key, scaling, causal, interpret=interpret)
  raise ValueError(f"implementation: expected None or one of {IMPLEMENTATIONS}, got "
                   f"{implementation!r}")
