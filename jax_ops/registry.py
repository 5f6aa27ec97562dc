"""The implementations behind each differentiable op's backward pass.

Each op names its backward computation; each computation maps implementation
names to functions with the reference's signature (plus ``interpret`` for the
Pallas ones). ``"xla"`` is the pure-jnp reference. ``"pallas"`` is the Pallas
Triton kernel, the one GPU ``pallas_call`` path in jax 0.11; a Mosaic GPU
version would register under its own name beside it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

import pallas_kernels
from jax_ops import reference

XLA = "xla"
PALLAS = "pallas"

_BACKWARDS: dict[str, dict[str, Callable]] = {
    "attention_softmax_dropout_value": {
        XLA: reference.attention_softmax_dropout_value_backward_reference,
        PALLAS: pallas_kernels.attention_softmax_dropout_value_backward,
    },
    "masked_softmax_dropout": {
        XLA: reference.masked_softmax_dropout_backward_reference,
        PALLAS: pallas_kernels.masked_softmax_dropout_backward,
    },
    "qk_scale_softmax": {
        XLA: reference.qk_scale_softmax_backward_reference,
        PALLAS: pallas_kernels.qk_scale_softmax_backward,
    },
}


# Ops whose Pallas backward is what ``implementation=None`` picks on a GPU: only
# those measured faster than XLA on every benchmark workload (benchmarks/results/;
# today all three). A kernel added later that is not yet faster everywhere stays
# selectable with ``implementation="pallas"`` without becoming the default.
_PALLAS_BY_DEFAULT = {"masked_softmax_dropout", "attention_softmax_dropout_value",
                      "qk_scale_softmax"}


def register(op: str, name: str, fn: Callable) -> None:
  """Adds (or replaces) implementation ``name`` of ``op``'s backward pass."""
  _BACKWARDS[op][name] = fn


def available(op: str) -> tuple[str, ...]:
  return tuple(_BACKWARDS[op])


def resolve(op: str, implementation: str | None, interpret: bool) -> tuple[str, Callable]:
  """Picks ``op``'s backward: ``None`` means the Pallas kernel where one exists
  for the device (a GPU, or any backend with ``interpret=True``) and is the
  measured default for the op, else XLA.

  Returns the implementation's name and a function of the reference's
  arguments (Pallas kernels get ``interpret`` bound; keywords such as
  ``causal`` pass through).
  """
  impls = _BACKWARDS[op]
  if implementation is None:
    use_pallas = (PALLAS in impls and op in _PALLAS_BY_DEFAULT
                  and (interpret or jax.default_backend() == "gpu"))
    implementation = PALLAS if use_pallas else XLA
  if implementation not in impls:
    raise ValueError(
        f"implementation: expected one of {sorted(impls)} or None for {op}, got {implementation!r}")
  if implementation == PALLAS and not interpret and jax.default_backend() != "gpu":
    raise ValueError(
        f"implementation='pallas': the Pallas Triton kernels compile only for a CUDA GPU; on "
        f"the {jax.default_backend()!r} backend pass interpret=True (or leave implementation=None)")
  fn = impls[implementation]
  if implementation == PALLAS:
    fn = functools.partial(fn, interpret=interpret)
  return implementation, fn
