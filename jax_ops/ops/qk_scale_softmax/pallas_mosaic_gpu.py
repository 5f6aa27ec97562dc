"""The ``"mosaic_gpu"`` backend of the qk_scale_softmax backward: a Pallas Mosaic GPU kernel
for Hopper.

Kernel: :mod:`pallas_kernels.qk_scale_softmax.pallas_mosaic_gpu` (TMA streams, wgmma, one
producer and two consumer warpgroups; ``g`` and ``P`` read once). The problems it takes are
those of :func:`pallas_kernels.qk_scale_softmax.dispatch.mosaic_gpu_reason` (rows of 128
keys, ``D == 128``); it computes the op's ``dL`` (``renormalize=True``: P corrected to sum to
1, ``dL`` rounded once). Forced with ``implementation="mosaic_gpu"`` on another problem or
device it raises saying why. Residuals: Q, K and P. The op's forward is the Triton
backend's (:func:`jax_ops.ops.qk_scale_softmax.pallas_triton.pallas_forward`).
"""

from __future__ import annotations

from pallas_kernels import qk_scale_softmax as kernels
from pallas_kernels.qk_scale_softmax import dispatch
from jax_ops import backend
from jax_ops.ops.qk_scale_softmax.pallas_triton import pallas_forward


class QKSoftmaxMosaicGpu(backend.MosaicGpuBackend):
  """The op's Mosaic GPU backend (name, devices, priority and the support checks from the
  base class; :meth:`reason` says what of a problem the kernel does not take)."""

  def reason(self, problem):
    shapes = dict(problem.shapes)
    if "query" not in shapes or "key" not in shapes:
      return "a problem without the shapes of query and key"
    return dispatch.mosaic_gpu_reason(shapes["query"], shapes["key"], problem.dtype, 1.0)

  def forward(self, query, key, scaling, *, causal=False, interpret=False):
    """The op's forward: :func:`jax_ops.ops.qk_scale_softmax.pallas_triton.pallas_forward`."""
    return pallas_forward(query, key, scaling, causal=causal, interpret=interpret)

  def backward(self, grad_output, query, key, attn_weights, scaling, *, causal=False,
               interpret=False):
    return kernels.qk_scale_softmax_backward(grad_output, query, key, attn_weights, scaling,
                                             causal=causal, implementation="mosaic_gpu",
                                             renormalize=True, interpret=interpret)


BACKEND = QKSoftmaxMosaicGpu()
