"""The ``"mosaic_gpu"`` backend of op C's backward: a Pallas Mosaic GPU kernel for Hopper.

Kernel: :mod:`pallas_kernels.qk_scale_softmax.pallas_mosaic_gpu` (TMA streams, wgmma, one
producer and two consumer warpgroups; ``g`` and ``P`` read once). It takes bf16/fp16
problems with ``D == 128``, ``seq_q % 64 == 0`` and ``seq_k == 128`` (:meth:`supports`),
causal or not (it computes the tiles above the diagonal too and is still faster there than
the Triton kernels that skip them). Rows of 256 keys take the Triton kernels: the kernel
entry point's Mosaic GPU pair kernel (``implementation="mosaic_gpu"`` there) measured
slower. Forced with ``implementation="mosaic_gpu"`` on another problem or device it
raises saying why. Residuals: Q, K and P. The op's forward is the Triton backend's
(:func:`jax_ops.ops.qk_scale_softmax.pallas_triton.pallas_forward`): at 128 keys the fused Pallas
Triton forward kernel, measured faster there than the Mosaic GPU forward.
"""

from __future__ import annotations

from pallas_kernels import qk_scale_softmax as kernels
from pallas_kernels.qk_scale_softmax import pallas_mosaic_gpu as mosaic
from jax_ops import backend
from jax_ops.ops.qk_scale_softmax.pallas_triton import pallas_forward


class QKSoftmaxMosaicGpu(backend.MosaicGpuBackend):
  """The op's Mosaic GPU backend (name, devices, priority and the support checks from the
  base class; :meth:`reason` says what of a problem the kernels do not take)."""

  def reason(self, problem):
    shapes = dict(problem.shapes)
    if "query" not in shapes or "key" not in shapes:
      return "a problem without the shapes of query and key"
    b, h, sq, d = shapes["query"]
    sk = shapes["key"][2]
    why = mosaic.unsupported_reason(b, h, sq, sk, d, problem.dtype, 1.0)
    if why is None and sk != mosaic.SEQ_K:
      return (f"seq_k {sk} in the op (rows of {mosaic.SEQ_K} keys only; at {sk} it measured "
              "slower than the Triton kernels)")
    return why

  def config(self, problem):
    """The kernel has no config: its tiles follow from the shapes."""
    return None

  def forward(self, query, key, scaling, *, causal=False, interpret=False):
    """The op's forward: :func:`jax_ops.ops.qk_scale_softmax.pallas_triton.pallas_forward`."""
    return pallas_forward(query, key, scaling, causal=causal, interpret=interpret)

  def backward(self, grad_output, query, key, attn_weights, scaling, *, causal=False,
               interpret=False):
    return kernels.qk_scale_softmax_backward(grad_output, query, key, attn_weights, scaling,
                                             causal=causal, implementation="mosaic_gpu",
                                             interpret=interpret)


BACKEND = QKSoftmaxMosaicGpu()
