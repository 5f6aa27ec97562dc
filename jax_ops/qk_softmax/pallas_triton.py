"""The ``"triton"`` backend of op C's backward: Pallas Triton kernels, any CUDA GPU.

Config and heuristic: ``pallas_kernels.qk_scale_softmax.default_config`` (tuned tables per
device kind, a heuristic elsewhere). Residuals: Q, K and P (the reference backward's
arguments). A causal call skips the key tiles above the diagonal.
"""

from __future__ import annotations

from pallas_kernels import qk_scale_softmax as kernels
from pallas_kernels.qk_scale_softmax import pallas_triton
from jax_ops import backend


class QKSoftmaxTriton(backend.TritonBackend):
  """The op's Triton backend (name, devices and priority from the base class)."""

  def config(self, problem):
    """The kernels' default config for this problem on its device."""
    _, _, sq, d = problem.shape("query")
    sk = problem.shape("key")[2]
    kind = self.device_kind(problem)
    return kernels.default_config(sq, sk, d, problem.dtype, kind)

  def backward(self, grad_output, query, key, attn_weights, scaling, *, causal=False,
               interpret=False):
    return pallas_triton.qk_scale_softmax_backward(
        grad_output, query, key, attn_weights, scaling, causal=causal, interpret=interpret)


BACKEND = QKSoftmaxTriton()
