"""The backend interface: one object per implementation of an op's backward pass.

An op (``jax_ops.attention_softmax_dropout_value`` and the others) is a ``jax.custom_vjp``
whose backward comes from a :class:`Backend` that the registry (:mod:`jax_ops.registry`)
picks by name, device and problem. Its forward is plain jnp unless the backend's residual
policy brings a forward kernel (``"scores"``, ``"fused_inputs"``, ``"fused_output"``) or the
backend has a ``forward`` (``qk_scale_softmax``). A backend says:

* ``name``: what ``implementation=`` takes (``"xla"``, ``"triton"``, ``"mosaic_gpu"``);
* ``pallas``: whether it runs Pallas kernels (``implementation="pallas"`` takes the best
  Pallas backend for the device);
* ``priority``: the order in which ``implementation=None`` tries the backends that support
  a call (higher first);
* ``supported_on(device)``: the devices it compiles for (the interpreter runs Pallas
  backends anywhere; ``auto_in_interpreter``: whether ``implementation=None`` or
  ``"pallas"`` may pick it under ``interpret=True``);
* ``supports(problem)``: the shapes and dtypes it takes;
* ``residual_policy(problem)``: what the op's forward saves for it (the policies below;
  ``"inputs"``, the reference backward's arguments, is the default);
* ``backward(*args, causal=False, interpret=False)``: the backward with the reference
  backward's positional arguments. Under another policy the op calls that policy's methods:
  ``"scores"``: ``forward_from_scores`` and ``backward_from_scores``; ``"fused_inputs"``:
  ``forward_with_dropped`` and ``backward``; ``"fused_output"``: ``forward_with_output`` and
  ``backward_from_output`` (``"output"``: the jnp forward and ``backward_from_output``); both
  fused policies: ``forward_output`` for a value without a gradient;
* ``forward(query, key, scaling, *, causal=False, interpret=False)`` (``qk_scale_softmax``,
  optional): the op's forward ``P`` from the backend's own kernel; without it, the jnp
  forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from pallas_kernels._util import is_hopper

INPUTS = "inputs"  # the residual policy of the reference backward: its own arguments
# attention_softmax_dropout_value: P, V, keep and the forward's fp32 output
# (delta = rowsum(dO * O)).
OUTPUT = "output"
# masked_softmax_dropout: the backend's forward draws the keep mask itself, writes only its
# output and saves the scores (an input, alive anyway), the attention mask and the key; its
# backward recomputes P from the scores and redraws the mask.
SCORES = "scores"
# attention_softmax_dropout_value: as "output", with the backend's fused forward
# (``forward_with_output``), which draws the keep mask itself and returns (O, P, keep, O in
# fp32); "P" and "keep" are what the backend's ``backward_from_output`` takes: P and a bool
# mask (the Triton backend), or the unnormalized softmax E and (the key's seeds, E's row
# scales) (the Mosaic GPU backend, whose kernel draws the mask again and makes P = E * scale).
FUSED_OUTPUT = "fused_output"
# attention_softmax_dropout_value: the reference backward's P and Pd, from the backend's
# fused forward (``forward_with_dropped``), which draws the keep mask itself and does not
# store it; for a traced rate the jnp forward and "inputs" (keep saved).
FUSED_INPUTS = "fused_inputs"


@dataclasses.dataclass(frozen=True)
class Problem:
  """What a backend may look at to say whether it takes a call: the op's name, the shapes
  of its arrays by argument name, their dtype, ``causal``, the device (the ops pass
  :func:`pallas_kernels._util.device_of`'s: under ``jax.jit``, the default device; ``None``
  only where a caller builds a problem without one) and whether the Pallas interpreter is
  asked for."""
  op: str
  shapes: tuple[tuple[str, tuple[int, ...]], ...]
  dtype: str
  causal: bool = False
  device: jax.Device | None = None
  interpret: bool = False

  def shape(self, name: str) -> tuple[int, ...]:
    return dict(self.shapes)[name]


class Backend:
  """Base class of a backend; subclasses set the class attributes and ``backward``."""

  name: str = ""
  pallas: bool = False
  priority: int = 0
  auto_in_interpreter: bool = True

  def supported_on(self, device: jax.Device | None) -> bool:
    """Whether the backend compiles for ``device``."""
    return True

  def supports(self, problem: Problem) -> bool:
    """Whether the backend takes these shapes and dtypes (checked arguments)."""
    return True

  def unsupported_reason(self, problem: Problem) -> str:
    """Why ``supports(problem)`` is False, for the error of a forced implementation."""
    return "the backend does not take these shapes"

  def residual_policy(self, problem: Problem) -> str:
    return INPUTS

  def backward(self, *args, causal: bool = False, interpret: bool = False):
    raise NotImplementedError

  def __repr__(self):
    return f"<{type(self).__name__} {self.name!r}>"


class FunctionBackend(Backend):
  """A backend made from a function with the reference backward's signature
  (``jax_ops.registry.register(op, name, fn)``). It takes every device and shape, keeps
  the default residual policy and is never picked by ``implementation=None``. The function
  gets ``causal=`` and ``interpret=`` only if its signature names them."""

  priority = -1

  def __init__(self, name: str, fn: Callable):
    import inspect
    self.name = name
    self.fn = fn
    try:
      params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
      params = {}
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    self._takes = {k for k in ("causal", "interpret") if var_kw or k in params}

  def backward(self, *args, causal: bool = False, interpret: bool = False):
    kwargs = {k: v for k, v in (("causal", causal), ("interpret", interpret))
              if k in self._takes}
    return self.fn(*args, **kwargs)


class ReferenceBackend(Backend):
  """The ``"xla"`` backend of an op: its plain-jnp reference backward. Every device and shape;
  the residuals are the reference's arguments; ``causal`` is not needed (a causal P is zero
  above the diagonal, which the dense math handles)."""

  name = "xla"
  priority = 0

  def __init__(self, reference: Callable):
    self.reference = reference

  def backward(self, *args, causal: bool = False, interpret: bool = False):
    del causal, interpret
    return self.reference(*args)


class TritonBackend(Backend):
  """Base of the ``"triton"`` backends: Pallas Triton kernels, for any CUDA GPU (and the
  interpreter anywhere). Their priority (10) puts them before ``"xla"`` (0) on a GPU; the
  timings are in ``docs/performance.md``."""

  name = "triton"
  pallas = True
  priority = 10

  def supported_on(self, device):
    return device is not None and device.platform == "gpu"


class MosaicGpuBackend(Backend):
  """Base of the ``"mosaic_gpu"`` backends: Pallas Mosaic GPU kernels (TMA, wgmma, warp
  specialization) for Hopper GPUs. Their priority (20) puts them before Triton (10) where
  they take a problem; the timings are in ``docs/performance.md``. Under
  ``interpret=True`` they run only when named (``implementation="mosaic_gpu"``): the
  default interpreter path stays the portable Triton one."""

  name = "mosaic_gpu"
  pallas = True
  priority = 20
  auto_in_interpreter = False

  def supported_on(self, device):
    return is_hopper(device)

  def reason(self, problem) -> str | None:
    """What of ``problem`` the kernels do not take (``None``: they take it)."""
    raise NotImplementedError

  def supports(self, problem):
    return self.reason(problem) is None

  def unsupported_reason(self, problem):
    return f"the Mosaic GPU kernels do not take {self.reason(problem)}"
