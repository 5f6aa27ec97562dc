"""Small helpers shared by the kernels."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
# The Pallas interpreter imports the fuser lazily, on its first run, and the fuser registers a
# config that is part of JAX's tracing context: every function jitted before that run would
# then miss its cache and compile again on its second call. Importing it here, before anything
# is traced, keeps the context fixed.
import jax.experimental.pallas.fuser  # noqa: F401,E402

next_power_of_2 = pl.next_power_of_2


def dropout_scale(p: float) -> float:
  """``1 / (1 - p)`` for a static dropout rate ``p``, computed in fp32 as the ops' forward
  computes it (``jax_ops.reference``), so a kernel scales by the very factor the forward
  used and a backward that rebuilds Pd from P rebuilds it bit for bit. (In float64 the
  factor differs by one fp32 ulp for some rates, p = 0.15 for one.)"""
  one = np.float32(1.0)
  return float(one / (one - np.float32(p)))


def compiler_params(num_warps: int, num_stages: int):
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(*args, **kwargs):
  """``pl.pallas_call`` with the Triton lowering's deprecation warning silenced.

  The Triton lowering is deprecated upstream since jax 0.11 but is the portable GPU path
  (any CUDA GPU); the Mosaic GPU kernels are Hopper-only.
  """
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return pl.pallas_call(*args, **kwargs)


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
  """2D ``a @ b`` (optionally with transposed operands), fp32 accumulation.

  ``pl.dot`` is deprecated in this JAX; this is its body. The Triton lowering maps
  it to ``tt.dot`` (tensor cores for bf16/fp16 operands; transposes become
  ``tt.trans``). fp32 operands ask for HIGHEST: Triton's default for them is TF32.
  """
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jax.lax.dot_general(a, b, dims, precision=precision,
                             preferred_element_type=jnp.float32)


def out_struct(shape, dtype, *like) -> jax.ShapeDtypeStruct:
  """A kernel output's shape and dtype; inside ``jax.shard_map`` it varies over
  the mesh axes that any of the inputs ``like`` vary over (needed with check_vma)."""
  varying = frozenset()
  for x in like:
    mat = getattr(jax.typeof(x), "mat", None)
    if mat is not None:
      varying |= mat.varying
  if not varying:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


DROPOUT_MODES = ("none", "static", "traced")


@dataclasses.dataclass(frozen=True)
class Dropout:
  """How a kernel applies dropout; one vocabulary for all kernels (a static kernel argument).

  ``mode``: ``"none"`` (a concrete rate of 0: the keep mask is never read), ``"static"``
  (a concrete rate: ``scale = 1 / (1 - p)`` is a compile-time constant) or ``"traced"``
  (the rate is a run-time operand; the kernel reads its scale from memory).
  """
  mode: str
  scale: float | None = None

  def __post_init__(self):
    if self.mode not in DROPOUT_MODES:
      raise ValueError(f"dropout mode: expected one of {DROPOUT_MODES}, got {self.mode!r}")
    if (self.mode == "static") != (self.scale is not None):
      raise ValueError(f"dropout mode {self.mode!r}: a scale goes with 'static' only")

  @classmethod
  def of(cls, p_static: float | None) -> "Dropout":
    """The mode for a rate as ``validation.check_dropout_rate`` returns it (``None``: traced)."""
    if p_static is None:
      return cls("traced")
    if p_static == 0.0:
      return cls("none")
    return cls("static", dropout_scale(p_static))


def device_of(*arrays) -> jax.Device:
  """The device a call runs on: the first concrete array committed to a single device
  decides; under ``jax.jit`` (tracers hold no device) it is the default device
  (``jax.default_device``, a device or a platform name, if set; else ``jax.devices()[0]``).
  Arrays placed elsewhere inside a jitted function are not seen."""
  for x in arrays:
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      try:
        devices = x.devices()
      except Exception:  # an array without a concrete placement
        continue
      if len(devices) == 1:
        return next(iter(devices))
  default = jax.config.jax_default_device
  if isinstance(default, jax.Device):
    return default
  if isinstance(default, str):
    return jax.devices(default)[0]
  return jax.devices()[0]


def is_hopper(device) -> bool:
  """Whether ``device`` is a GPU of compute capability 9.x (H100, H200, GH200: sm_90a, the
  target of the Mosaic GPU kernels' wgmma)."""
  cap = getattr(device, "compute_capability", None)
  return (device is not None and device.platform == "gpu" and isinstance(cap, str)
          and cap.split(".")[0] == "9")


def check_can_compile(entry_point: str, interpret: bool, *arrays) -> None:
  """Raises a clear ``ValueError`` when a Triton kernel is asked to compile off a CUDA GPU.

  The Triton lowering compiles only for CUDA GPUs; elsewhere the kernels run in the Pallas
  interpreter (``interpret=True``). Without this check the caller would get JAX's bare
  "Only interpret mode is supported" from inside the lowering.
  """
  if interpret:
    return
  platform = device_of(*arrays).platform
  if platform not in ("gpu", "cuda"):
    raise ValueError(
        f"{entry_point}: the Pallas Triton kernels compile only for a CUDA GPU, and these "
        f"arrays are on the {platform!r} backend; pass interpret=True to run them in the "
        f"Pallas interpreter (slow; for tests)")


def enable_load_cache_modifiers(what: str = "cache_modifier", hint: str = ""):
  """Makes ``pltriton.load(cache_modifier=".ca" | ".cg")`` lower (jax 0.11.2).

  The Triton lowering accepts exactly those two strings, then looks them up in a table
  keyed by the dialect's names (``"ca"``, ``"cg"``): a ``KeyError`` for any modifier. This
  adds the dotted keys (idempotent; nothing else changes). Kernels that load with a cache
  modifier call it before lowering; ``what`` names the setting in the error if it cannot,
  ``hint`` says what to do instead.
  """
  try:
    from jax._src.pallas.triton import lowering
    names = lowering._STR_TO_CACHE_MODIFIER
  except (ImportError, AttributeError) as e:  # internals moved: say which config needs it
    raise NotImplementedError(
        f"{what}: this jax's Triton lowering has no cache modifier table to extend ({e})"
        + (f"; {hint}" if hint else "")) from e
  for name in (".ca", ".cg"):
    if name not in names and name[1:] in names:
      names[name] = names[name[1:]]


def first_paragraph(doc: str) -> str:
  """A module docstring's first paragraph on one line: a command-line tool's description."""
  return " ".join(doc.split("\n\n")[0].split())
