"""The backends of each op's backward pass, and how a call picks one.

``implementation=`` of every op takes:

* ``None``: the backend of highest priority that supports the device and the problem: on a
  Hopper GPU the Mosaic GPU kernels where they take the shapes, then the Triton kernels on
  any CUDA GPU (under ``interpret=True`` anywhere), else ``"xla"``; but ``"xla"`` on a GPU
  where the device's tuned table marks the problem's row-length class ``"backend": "xla"``
  (:func:`tuned_to_xla`). Never an error because of the device;
* ``"pallas"``: the best Pallas backend for the device;
* a backend's name (``"xla"``, ``"triton"``, ``"mosaic_gpu"`` (``attention_softmax_dropout_value``
  and ``qk_scale_softmax``), or one added with :func:`register`).

The builtin backends are listed by module path and imported on first use, so an op's code
never imports a backend file: adding one is a file with a :class:`jax_ops.backend.Backend`
subclass plus its line in ``_BUILTIN``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import jax

from jax_ops.backend import Backend, FunctionBackend, Problem
from pallas_kernels import _tuning
from pallas_kernels.attention_softmax_dropout_value import config as _attention_config
from pallas_kernels.masked_softmax_dropout import config as _masked_config
from pallas_kernels.qk_scale_softmax import config as _qk_config

XLA = "xla"
TRITON = "triton"
MOSAIC_GPU = "mosaic_gpu"
PALLAS = "pallas"  # an alias: the best Pallas backend for the device

OPS = ("attention_softmax_dropout_value", "masked_softmax_dropout", "qk_scale_softmax")

_BUILTIN = {
    "attention_softmax_dropout_value": {
        XLA: "jax_ops.ops.attention_softmax_dropout_value.xla",
        TRITON: "jax_ops.ops.attention_softmax_dropout_value.pallas_triton",
        MOSAIC_GPU: "jax_ops.ops.attention_softmax_dropout_value.pallas_mosaic_gpu",
    },
    "masked_softmax_dropout": {
        XLA: "jax_ops.ops.masked_softmax_dropout.xla",
        TRITON: "jax_ops.ops.masked_softmax_dropout.pallas_triton",
    },
    "qk_scale_softmax": {
        XLA: "jax_ops.ops.qk_scale_softmax.xla",
        TRITON: "jax_ops.ops.qk_scale_softmax.pallas_triton",
        MOSAIC_GPU: "jax_ops.ops.qk_scale_softmax.pallas_mosaic_gpu",
    },
}

_REGISTERED: dict[str, dict[str, Backend]] = {op: {} for op in OPS}


def _check_op(op: str) -> None:
  if op not in _REGISTERED:
    raise ValueError(f"op: expected one of {list(OPS)}, got {op!r}")


def register(op: str, name: str, backward: Callable | Backend) -> None:
  """Adds (or replaces) backend ``name`` of ``op``'s backward.

  ``backward`` is a :class:`~jax_ops.backend.Backend`, or a function with the reference
  backward's positional signature (``jax_ops.*_backward_reference``), which then takes
  every device and shape and is used when a call says ``implementation=name``.
  """
  _check_op(op)
  if not isinstance(name, str) or not name:
    raise TypeError(f"name: expected a non-empty string, got {name!r}")
  if isinstance(backward, type):
    raise TypeError(f"backward: expected a Backend instance or a function, got the class "
                    f"{backward.__name__}")
  if name == PALLAS:
    raise ValueError(f"name: {PALLAS!r} is the alias of the best Pallas backend; pick another")
  if not isinstance(backward, Backend):
    if not callable(backward):
      raise TypeError(f"backward: expected a Backend or a function, got {type(backward).__name__}")
    backward = FunctionBackend(name, backward)
  elif backward.name != name:
    raise ValueError(f"backward: its name {backward.name!r} differs from name {name!r}")
  _REGISTERED[op][name] = backward


def unregister(op: str, name: str) -> None:
  """Removes a backend added with :func:`register` (builtin ones stay)."""
  _check_op(op)
  _REGISTERED[op].pop(name, None)


def available(op: str) -> tuple[str, ...]:
  """The backend names of ``op``: the builtin ones, then those registered."""
  _check_op(op)
  return tuple(dict.fromkeys([*_BUILTIN[op], *_REGISTERED[op]]))


def get(op: str, name: str) -> Backend:
  """The backend ``name`` of ``op`` (not the ``"pallas"`` alias: see :func:`resolve`)."""
  _check_op(op)
  if name in _REGISTERED[op]:
    return _REGISTERED[op][name]
  if name in _BUILTIN[op]:
    return importlib.import_module(_BUILTIN[op][name]).BACKEND
  raise ValueError(f"implementation: expected one of {sorted(available(op))}, "
                   f"{PALLAS!r} or None for {op}, got {name!r}")


def _usable(backend: Backend, problem: Problem) -> bool:
  if problem.interpret and backend.pallas:
    on_device = True  # the Pallas interpreter runs anywhere
  else:
    on_device = backend.supported_on(problem.device)
  return on_device and backend.supports(problem)


# Per op, whether the tuned table of a device kind sends ``problem`` to XLA: each op's
# ``config.runs_xla`` on the problem's shapes.
_RUNS_XLA = {
    "attention_softmax_dropout_value": lambda kind, p: _attention_config.runs_xla(
        kind, p.shape("scores")[3], p.shape("value_states")[3], p.dtype),
    "masked_softmax_dropout": lambda kind, p: _masked_config.runs_xla(kind, p.shape("scores")[3]),
    "qk_scale_softmax": lambda kind, p: _qk_config.runs_xla(
        kind, p.shape("key")[2], p.shape("key")[3], p.dtype, p.causal),
}


def tuned_to_xla(op: str, problem: Problem) -> bool:
  """Whether ``implementation=None`` runs ``"xla"`` for ``problem`` because the tuned table
  of its device (``_tuning.table_kind``) says ``"backend": "xla"`` for its class (each op's
  ``config.runs_xla``): compiled calls on a GPU only."""
  device = problem.device
  if problem.interpret or device is None or getattr(device, "platform", None) != "gpu":
    return False
  try:
    return _RUNS_XLA[op](_tuning.table_kind(device), problem)
  except KeyError:  # a problem without the op's shapes (a bare query) has no class
    return False


def resolve(op: str, implementation: str | None, problem: Problem) -> Backend:
  """The backend a call of ``op`` uses (see the module docstring). A forced name raises
  ``ValueError`` saying why when its backend does not take the device or the problem."""
  _check_op(op)
  if implementation is None and tuned_to_xla(op, problem):
    return get(op, XLA)
  if implementation is None or implementation == PALLAS:
    backends = [get(op, n) for n in available(op)]
    if implementation == PALLAS:
      backends = [b for b in backends if b.pallas]
    usable = [b for b in backends if _usable(b, problem)
              and (b.auto_in_interpreter or not problem.interpret)]
    if usable:
      return max(usable, key=lambda b: b.priority)
    if implementation is None:
      return get(op, XLA)
    device = problem.device.platform if problem.device is not None else jax.default_backend()
    raise ValueError(
        f"implementation='pallas': no Pallas backend of {op} takes this call on the "
        f"{device!r} backend (the Triton kernels compile only for a CUDA GPU); pass "
        f"interpret=True to run them in the Pallas interpreter, or leave implementation=None")
  if not isinstance(implementation, str):
    raise TypeError(f"implementation: expected a backend name or None, got "
                    f"{type(implementation).__name__}")
  backend = get(op, implementation)
  if not (problem.interpret and backend.pallas) and not backend.supported_on(problem.device):
    device = problem.device.platform if problem.device is not None else jax.default_backend()
    raise ValueError(
        f"implementation={implementation!r}: this backend of {op} does not compile for the "
        f"{device!r} backend" + ("; pass interpret=True to run it in the Pallas interpreter, "
                                 "or leave implementation=None" if backend.pallas else ""))
  if not backend.supports(problem):
    raise ValueError(f"implementation={implementation!r}: {backend.unsupported_reason(problem)}")
  return backend
