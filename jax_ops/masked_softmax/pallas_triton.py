"""The ``"triton"`` backend of op B's backward: a Pallas Triton row kernel, any CUDA GPU.

Config and heuristic: ``pallas_kernels.masked_softmax_dropout.default_config`` (tuned
tables per device kind, a heuristic elsewhere). Residuals: the reference backward's
arguments (P, the attention mask and the keep mask).
"""

from __future__ import annotations

import pallas_kernels
from pallas_kernels import masked_softmax_dropout as kernels
from jax_ops import backend


class MaskedSoftmaxTriton(backend.TritonBackend):
  """The op's Triton backend (name, devices and priority from the base class)."""

  def config(self, problem):
    """The kernel's default config for this problem on its device."""
    _, _, sq, sk = problem.shape("scores")
    kind = self.device_kind(problem)
    return kernels.default_config(sq, sk, kind)

  def backward(self, grad_output, p_attn, mask, dropout_mask, p_dropout, *, causal=False,
               interpret=False):
    return pallas_kernels.masked_softmax_dropout_backward(
        grad_output, p_attn, mask, dropout_mask, p_dropout, causal=causal, interpret=interpret)


BACKEND = MaskedSoftmaxTriton()
