"""The ``"triton"`` backend of op C's backward: Pallas Triton kernels, any CUDA GPU.

Config and heuristic: ``pallas_kernels.qk_scale_softmax.default_config`` (tuned tables per
device kind, a heuristic elsewhere). Residuals: Q, K and P (the reference backward's
arguments). A causal call skips the key tiles above the diagonal.

The op's forward is the fused forward kernel (:func:`pallas_forward`, shared with the Mosaic
GPU backend): ``Q @ K^T``, the scale, the causal mask and the softmax in one kernel, P
written once. Compiled on a Hopper GPU, dense rows of more than 256 keys take the Mosaic GPU
forward kernel (:mod:`pallas_kernels.qk_scale_softmax.forward_mosaic_gpu`, wgmma), measured
1.2-1.3x faster there; the Triton kernel everywhere else.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels import _tuning
from pallas_kernels import qk_scale_softmax as kernels
from pallas_kernels._util import device_of, is_hopper
from pallas_kernels.qk_scale_softmax import forward as forward_kernel
from pallas_kernels.qk_scale_softmax import forward_mosaic_gpu
from pallas_kernels.qk_scale_softmax import pallas_triton
from jax_ops import backend
from jax_ops.ops.qk_scale_softmax import reference


FORWARDS = ("auto", "triton", "mosaic_gpu")
MOSAIC_FORWARD_MIN_KEYS = 257
"""Rows of at most 256 keys take the Triton forward's one-tile path, measured faster than
the Mosaic GPU forward there (``benchmarks/results/runs/c_forward_mosaic_dd1b9d6.json``)."""


def forward_kernel_for(query, key, scaling, causal, interpret, forward="auto") -> str:
  """``"triton"`` or ``"mosaic_gpu"``: the forward kernel :func:`pallas_forward` runs.
  ``"auto"`` takes the Mosaic GPU kernel only compiled on a Hopper GPU, on the dense
  problems it takes with rows of at least :data:`MOSAIC_FORWARD_MIN_KEYS` keys."""
  if forward not in FORWARDS:
    raise ValueError(f"forward: expected one of {FORWARDS}, got {forward!r}")
  if forward != "auto":
    return forward
  b, h, seq_q, d = query.shape
  seq_k = key.shape[2]
  if interpret or seq_k < MOSAIC_FORWARD_MIN_KEYS or not is_hopper(device_of(query, key)):
    return "triton"
  scale = scaling if isinstance(scaling, (int, float)) else None
  why = forward_mosaic_gpu.unsupported_reason(b, h, seq_q, seq_k, d, query.dtype, scale,
                                              causal)
  return "triton" if why else "mosaic_gpu"


def pallas_forward(query, key, scaling, *, causal=False, interpret=False, forward="auto"):
  """The op's forward ``P`` from a fused Pallas kernel: the one :func:`forward_kernel_for`
  picks (the Triton kernel on any CUDA GPU or the interpreter; the Mosaic GPU kernel on a
  Hopper GPU). Problems past the Triton kernel's int32 offsets take the jnp forward."""
  if forward_kernel_for(query, key, scaling, causal, interpret, forward) == "mosaic_gpu":
    return forward_mosaic_gpu.qk_scale_softmax_forward(query, key, scaling, causal,
                                                       interpret=interpret)
  b, h, seq_q, d = query.shape
  if not forward_kernel.takes(b, h, seq_q, key.shape[2], d):
    return reference.qk_scale_softmax_forward(query, key, scaling, causal)
  return forward_kernel.qk_scale_softmax_forward(query, key, scaling, causal,
                                                 interpret=interpret)


class QKSoftmaxTriton(backend.TritonBackend):
  """The op's Triton backend (name, devices and priority from the base class).
  ``forward``: which fused forward kernel it runs (:data:`FORWARDS`; ``"auto"``: as
  :func:`forward_kernel_for` picks). ``scheme``: the backward's scheme on every problem it
  takes (``None``: the default config's; ``"dl_gemm"`` takes rows of at most
  :data:`kernels.MAX_DL_ROW` keys, ``"per_head"`` of at most ``MAX_PER_HEAD_ROW``)."""

  def __init__(self, name: str | None = None, forward: str = "auto", scheme: str | None = None):
    if forward not in FORWARDS:
      raise ValueError(f"forward: expected one of {FORWARDS}, got {forward!r}")
    if scheme not in (None, *kernels.SCHEMES):
      raise ValueError(f"scheme: expected None or one of {kernels.SCHEMES}, got {scheme!r}")
    if name is not None:
      self.name = name
    self.forward_kernel = forward
    self.scheme = scheme

  def config(self, problem):
    """The kernels' config for this problem on its device (the one :meth:`backward` runs)."""
    _, _, sq, d = problem.shape("query")
    sk = problem.shape("key")[2]
    return self._config(sq, sk, d, problem.dtype, self.device_kind(problem), problem.causal)

  def _config(self, sq, sk, d, dtype, kind, causal):
    """The default config, or with :attr:`scheme` set the tuned config of that scheme with
    the scheme forced (its own defaults where the table has no entry of it)."""
    if self.scheme is None:
      return kernels.default_config(sq, sk, d, dtype, kind, causal=causal)
    config = kernels.default_config(sq, sk, d, dtype, kind, schemes=(self.scheme,))
    return dataclasses.replace(config, scheme=self.scheme)

  def supports(self, problem):
    return self.reason(problem) is None

  def unsupported_reason(self, problem):
    return f"the Triton kernels with scheme {self.scheme!r} do not take {self.reason(problem)}"

  def reason(self, problem) -> str | None:
    """What of ``problem`` a forced :attr:`scheme` does not take (``None``: it takes it)."""
    if self.scheme is None or "key" not in dict(problem.shapes):
      return None
    sk = problem.shape("key")[2]
    width = kernels.dl_width(sk)  # the padded row, as both schemes pad it
    limit = {"dl_gemm": kernels.MAX_DL_ROW, "per_head": kernels.MAX_PER_HEAD_ROW}.get(
        self.scheme)
    if limit is not None and width > limit:
      return f"rows of {sk} keys (key.shape[2]; at most {limit})"
    return None

  def forward(self, query, key, scaling, *, causal=False, interpret=False):
    """The op's forward: the fused forward kernel (:func:`pallas_forward`)."""
    return pallas_forward(query, key, scaling, causal=causal, interpret=interpret,
                          forward=self.forward_kernel)

  def backward(self, grad_output, query, key, attn_weights, scaling, *, causal=False,
               interpret=False):
    config = None
    if self.scheme is not None:
      kind = _tuning.device_kind_of(grad_output, query, key, attn_weights, interpret=interpret)
      config = self._config(query.shape[2], key.shape[2], query.shape[3], query.dtype, kind,
                            causal)
    return pallas_triton.qk_scale_softmax_backward(
        grad_output, query, key, attn_weights, scaling, causal=causal, config=config,
        interpret=interpret)


BACKEND = QKSoftmaxTriton()
