"""The ``"triton"`` backend of the qk_scale_softmax backward: Pallas Triton kernels, any CUDA GPU.

Config and heuristic: ``pallas_kernels.qk_scale_softmax.default_config`` (tuned tables per
device kind, a heuristic elsewhere). The backward computes the op's ``dL``
(``renormalize=True``: P corrected to sum to 1, ``dL`` rounded once). Residuals: Q, K and P
(the reference backward's arguments). A causal call skips the key tiles above the diagonal.
The op's forward is the fused forward kernel (:func:`pallas_forward`, shared with the Mosaic
GPU backend).
"""

from __future__ import annotations

from pallas_kernels.qk_scale_softmax import dispatch, pallas_triton
from jax_ops import backend
from jax_ops.ops.qk_scale_softmax import reference


def pallas_forward(query, key, scaling, *, causal=False, interpret=False):
  """The op's forward ``P`` from the fused Pallas kernel that
  :func:`pallas_kernels.qk_scale_softmax.forward_kernel_for` picks (``Q @ K^T``, the scale,
  the causal mask and the softmax in one kernel; P written once); the jnp forward where no
  Pallas forward takes the problem. The op has checked the arguments; the kernel's entry
  point checks them again, the rule runs once."""
  kernel = dispatch.pick_forward(query, key, scaling, causal=causal, interpret=interpret)
  if kernel is None:
    return reference.qk_scale_softmax_forward(query, key, scaling, causal)
  return dispatch.qk_scale_softmax_forward(query, key, scaling, causal=causal,
                                           implementation=kernel, interpret=interpret)


class QKSoftmaxTriton(backend.TritonBackend):
  """The op's Triton backend (name, devices and priority from the base class)."""

  def forward(self, query, key, scaling, *, causal=False, interpret=False):
    """The op's forward: the fused forward kernel (:func:`pallas_forward`)."""
    return pallas_forward(query, key, scaling, causal=causal, interpret=interpret)

  def backward(self, grad_output, query, key, attn_weights, scaling, *, causal=False,
               interpret=False):
    return pallas_triton.qk_scale_softmax_backward(
        grad_output, query, key, attn_weights, scaling, causal=causal, renormalize=True,
        interpret=interpret)


BACKEND = QKSoftmaxTriton()
