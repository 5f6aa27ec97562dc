"""The kernel entry point of the QK-scale-softmax backward: it picks the Mosaic GPU kernel
(:mod:`.pallas_mosaic_gpu`) on a Hopper GPU for the problems it takes, and the Triton kernels
(:mod:`.pallas_triton`) everywhere else."""

from __future__ import annotations

from pallas_kernels import validation
from pallas_kernels._util import device_of, is_hopper
from pallas_kernels.qk_scale_softmax import pallas_mosaic_gpu, pallas_triton

MOSAIC_GPU = "mosaic_gpu"
TRITON = "triton"
IMPLEMENTATIONS = (MOSAIC_GPU, TRITON)
_TRITON_OPTIONS = ("config", "block_q", "block_k", "num_warps", "num_stages")


def kernels_for(grad_output, query, key, attn_weights, scaling, *, causal=False,
                interpret=False) -> str:
  """``"mosaic_gpu"`` or ``"triton"``: the kernels that ``implementation=None`` runs.

  The Mosaic GPU kernel on a Hopper GPU for rows of 128 keys that
  :func:`pallas_mosaic_gpu.unsupported_reason` allows (``D == 128``; measured faster there:
  ``benchmarks/results/qk_scale_softmax.md``); the Triton kernels otherwise (rows of 256
  keys too: the Mosaic GPU pair kernel measured 0.82-0.90x their speed,
  ``benchmarks/results/qk_scale_softmax_mosaic_gpu.md``), and always
  under ``interpret=True`` (the portable path; name ``"mosaic_gpu"`` to run the Mosaic GPU
  interpreter). A causal P takes the same choice: the Mosaic GPU kernel computes every tile
  (the dense math gives the causal result) and still beats the Triton kernels that skip
  the tiles above the diagonal (``benchmarks/results/qk_scale_softmax_causal.md``).
  """
  scale = validation.check_problem_c(grad_output, query, key, attn_weights, scaling,
                                     dtypes=pallas_triton._SUPPORTED)
  if interpret or not is_hopper(device_of(grad_output, query, key, attn_weights)):
    return TRITON
  b, h, sq, d = query.shape
  sk = key.shape[2]
  why = pallas_mosaic_gpu.unsupported_reason(b, h, sq, sk, d, query.dtype, scale)
  return TRITON if why or sk != pallas_mosaic_gpu.SEQ_K else MOSAIC_GPU


def qk_scale_softmax_backward(grad_output, query, key, attn_weights, scaling, *,
                              causal=False, implementation: str | None = None,
                              interpret=False, **triton_options):
  """Backward of ``softmax((Q @ K^T) * scaling)`` to ``Q`` and ``K`` (problem C's kernel
  entry point).

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
  args = (grad_output, query, key, attn_weights, scaling)
  chosen = sorted(k for k, v in triton_options.items() if v is not None)
  if implementation is None:
    implementation = (TRITON if chosen
                      else kernels_for(*args, causal=causal, interpret=interpret))
  if implementation == MOSAIC_GPU:
    if chosen:
      raise TypeError(f"implementation='mosaic_gpu' takes no Triton options, got {chosen}")
    return pallas_mosaic_gpu.qk_scale_softmax_backward(*args, causal=causal,
                                                       interpret=interpret)
  if implementation == TRITON:
    return pallas_triton.qk_scale_softmax_backward(*args, causal=causal, interpret=interpret,
                                                   **triton_options)
  raise ValueError(f"implementation: expected None or one of {IMPLEMENTATIONS}, got "
                   f"{implementation!r}")
