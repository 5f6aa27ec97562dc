"""The ``"triton"`` backend of op C's backward: Pallas Triton kernels, any CUDA GPU.

Config and heuristic: ``pallas_kernels.qk_scale_softmax.default_config`` (tuned tables per
device kind, a heuristic elsewhere). Residuals: Q, K and P (the reference backward's
arguments). A causal call skips the key tiles above the diagonal.

The op's forward is the fused forward kernel (:func:`pallas_forward`, shared with the Mosaic
GPU backend): ``Q @ K^T``, the scale, the causal mask and the softmax in one kernel, P
written once.
"""

from __future__ import annotations

from pallas_kernels import qk_scale_softmax as kernels
from pallas_kernels.qk_scale_softmax import forward as forward_kernel
from pallas_kernels.qk_scale_softmax import pallas_triton
from jax_ops import backend
from jax_ops.qk_softmax import reference


def pallas_forward(query, key, scaling, *, causal=False, interpret=False):
  """The op's forward ``P`` from the fused Pallas Triton kernel (any CUDA GPU, or the
  interpreter); problems past its int32 offsets take the jnp forward."""
  b, h, seq_q, d = query.shape
  if not forward_kernel.takes(b, h, seq_q, key.shape[2], d):
    return reference.qk_scale_softmax_forward(query, key, scaling, causal)
  return forward_kernel.qk_scale_softmax_forward(query, key, scaling, causal,
                                                 interpret=interpret)


class QKSoftmaxTriton(backend.TritonBackend):
  """The op's Triton backend (name, devices and priority from the base class)."""

  def config(self, problem):
    """The kernels' default config for this problem on its device."""
    _, _, sq, d = problem.shape("query")
    sk = problem.shape("key")[2]
    kind = self.device_kind(problem)
    return kernels.default_config(sq, sk, d, problem.dtype, kind)

  def forward(self, query, key, scaling, *, causal=False, interpret=False):
    """The op's forward: the fused forward kernel (:func:`pallas_forward`)."""
    return pallas_forward(query, key, scaling, causal=causal, interpret=interpret)

  def backward(self, grad_output, query, key, attn_weights, scaling, *, causal=False,
               interpret=False):
    return pallas_triton.qk_scale_softmax_backward(
        grad_output, query, key, attn_weights, scaling, causal=causal, interpret=interpret)


BACKEND = QKSoftmaxTriton()
