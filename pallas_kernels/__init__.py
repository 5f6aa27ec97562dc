"""Pallas GPU kernels for the backward passes of eager-mode attention.

Kernels only: arrays in, arrays out, no autodiff. The differentiable ops that
use them live in :mod:`jax_ops`.
"""

from pallas_kernels.masked_softmax_dropout import masked_softmax_dropout_backward

__all__ = ["masked_softmax_dropout_backward"]
