"""Kernel A's Mosaic GPU kernels on the H200: compile, check and time variants in one run.

Usage (on a Hopper GPU)::

    PYTHONPATH=. python3 -m benchmarks.a_mosaic_variants [--workloads 0,2,3] [--out DIR]

For each aligned workload: the Triton entry point, and each Mosaic GPU variant (the two
kernels' tiles and pipeline depths), checked against the reference with the workload's
tolerance and timed the way ``benchmarks.run`` times (device time, input sets rotated so
L2 is cold); plus each Mosaic kernel alone. With ``ragged*`` variants named
(:data:`RAGGED_VARIANTS`), the workloads the Mosaic GPU kernels do not take run the Triton
entry point and those variants of ``ragged_mosaic_gpu`` (``--parts``: its passes alone,
:func:`ragged_fns`), e.g. ``--workloads 1,5,8 --variants ragged_mosaic,ragged --parts``.
Prints one table; writes ``<out>/a_mosaic_variants.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

from benchmarks import run, variants_table
from jax_ops import reference
from pallas_kernels.attention_softmax_dropout_value import pallas_mosaic_gpu as mg
from pallas_kernels.attention_softmax_dropout_value import pallas_triton
from pallas_kernels.attention_softmax_dropout_value import ragged_mosaic_gpu as rg

# name -> the Mosaic GPU entry point's Config (the default first: None, default_config's)
VARIANTS = {
    "default": None,
    "base": mg.Config(),   # Config()'s fields: at 256 keys the mirror kernel
    "dk128": mg.Config(delta_rows=64, delta_block_k=128, delta_stages=2),
    "split1": mg.Config(split=1),
    "split2": mg.Config(split=2),
    "stages3": mg.Config(stages=3),
    "bits": mg.Config(keep_bits=True),
    "bits_dk128": mg.Config(keep_bits=True, delta_rows=64, delta_block_k=128, delta_stages=2),
    "nofence": mg.Config(proxy_fence=False),   # no fence.proxy.async before slot releases
    "two_kernels": mg.Config(mirror_delta=False),   # rows of 256 keys: the delta kernel too
    # rows of 256-1024 keys: one kernel, the key blocks' programs a cluster exchanging delta
    "cluster": mg.Config(cluster_delta=True),
    "cluster_s3": mg.Config(cluster_delta=True, stages=3),
    # the same, the parts sent with st.async into the peers' shared memory
    "cluster_async": mg.Config(cluster_delta=True, cluster_exchange="async_store"),
    # fewer programs per launch: clusters of 4-8 programs fill a wave (run 9's probe)
    "cluster_async_s1": mg.Config(cluster_delta=True, cluster_exchange="async_store", split=1),
    "cluster_async_s2": mg.Config(cluster_delta=True, cluster_exchange="async_store", split=2),
    # the delta kernel on one program per SM, each looping over row tiles
    "persist64": mg.Config(delta_persistent=True, delta_rows=64, delta_stages=4),
    "persist64_k128": mg.Config(delta_persistent=True, delta_rows=64, delta_block_k=128,
                                delta_stages=2),
}


# Rows whose length is not a multiple of 128 keys (the ragged workloads): the Triton first
# pass and the Mosaic GPU dS pass of ragged_mosaic_gpu; name -> its keywords.
RAGGED_VARIANTS = {
    # the Triton first pass (dV, delta's partials), then the Mosaic GPU dS pass
    "ragged": {"first_pass": "triton"},
    "ragged_s3": {"first_pass": "triton", "stages": 3},
    "ragged_split1": {"first_pass": "triton", "split": 1},
    # delta from XLA's Pd @ V, dV in the Mosaic GPU pass
    "ragged_xla": {"first_pass": "xla"},
    "ragged_xla_s3": {"first_pass": "xla", "stages": 3},
    # delta from the module's Mosaic GPU delta kernel, dV in the Mosaic GPU dS pass
    "ragged_mosaic": {"first_pass": "mosaic"},
    "ragged_mosaic_s3": {"first_pass": "mosaic", "stages": 3},
    "ragged_mosaic_s4": {"first_pass": "mosaic", "stages": 4},
    "ragged_mosaic_plain": {"first_pass": "mosaic", "swizzle": False},   # bank conflicts
}


def ragged_fns(rate, names, parts):
  """The ragged backward per variant; with ``parts``, its passes alone (the Triton first
  pass, the Mosaic GPU delta kernel, and the dS pass from a given delta, without and with
  dV; each pass's gathers of dO and V included)."""
  fns = {n: jax.jit(lambda *a, kw=RAGGED_VARIANTS[n]: rg.attention_softmax_dropout_value_backward(
      *a, rate, **kw)) for n in names}
  if parts:
    fns["triton:dv"] = jax.jit(lambda d_o, probs, dropped, value, keep: rg.triton_first_pass(
        d_o, dropped, value))
    zero_delta = lambda probs: jnp.zeros(probs.shape[:3], jnp.float32)
    fns["ragged:ds"] = jax.jit(lambda d_o, probs, dropped, value, keep: rg.ds_pass(
        d_o, probs, dropped, value, zero_delta(probs), rate=rate))
    fns["ragged:ds_dv"] = jax.jit(lambda d_o, probs, dropped, value, keep: rg.ds_pass(
        d_o, probs, dropped, value, zero_delta(probs), rate=rate, with_dv=True))
    fns["ragged:delta"] = jax.jit(lambda d_o, probs, dropped, value, keep: rg.delta_pass(
        d_o, dropped, value))
  return fns


def mosaic_fn(variant, rate):
  def fn(d_o, probs, dropped, value, keep):
    b, h, sq, skv = probs.shape
    config = VARIANTS[variant] or mg.default_config(b, h, value.shape[1], sq, skv,
                                                    value.shape[3])
    return mg._backward(d_o, probs, dropped, value, rate=rate, config=config, interpret=False)
  return jax.jit(fn)


def parts_fns(variant, rate):
  """The delta kernel alone, and the dS-dV kernel (with its dV sum) alone, in their
  default mode: a ``keep_bits`` variant's parts are timed reading Pd, as the default (and
  the default's, with ``Config()``'s fields)."""
  config = VARIANTS[variant] or mg.Config()

  def groups(x, value):
    b, h, sq, skv = x.shape
    return x.reshape(b, value.shape[1], -1, skv)

  @jax.jit
  def delta_only(d_o, probs, dropped, value, keep):
    return mg.delta_pass(d_o, groups(dropped, value), value, rows=config.delta_rows,
                         block_k=config.delta_block_k, stages=config.delta_stages,
                         proxy_fence=config.proxy_fence,
                         programs=mg.SMS if config.delta_persistent else None)

  @jax.jit
  def ds_dv_only(d_o, probs, dropped, value, keep):
    b, h, sq, skv = probs.shape
    kvh = value.shape[1]
    delta = (None if skv == mg.WGS * mg.KEYS
             else jnp.zeros((b, kvh, (h // kvh) * sq), jnp.float32))
    split = mg.resolve_split(config.split, b, kvh, skv, (h // kvh) * sq // mg.ROWS)
    return mg.ds_dv_pass(d_o, groups(probs, value), groups(dropped, value), delta, value,
                         rate=rate, stages=config.stages, split=split,
                         proxy_fence=config.proxy_fence)
  return delta_only, ds_dv_only


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--workloads", default=None)
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--parts", action="store_true")
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--out", default=".")
  args = parser.parse_args(argv)
  spec, idx, ceiling = variants_table.setup("attention_softmax_dropout_value_backward",
                                            args.workloads)
  c = spec["constants"]
  rate = c["attention_dropout"]
  triton = jax.jit(lambda *a: pallas_triton.attention_softmax_dropout_value_backward(*a, rate))
  xla = jax.jit(lambda *a: reference.attention_softmax_dropout_value_backward_reference(*a, rate))
  rows = []
  for i in idx:
    w = spec["workloads"][i]
    dims = run._a_dims(w, c)
    b, h, kvh, sq, skv, d = dims
    why = mg.unsupported_reason(b, h, kvh, sq, skv, d, jnp.bfloat16, rate, False)
    label = run.PROBLEM_A.label(w)
    ragged = [v for v in args.variants.split(",") if v in RAGGED_VARIANTS]
    if why and not (ragged and rg.unsupported_reason(b, h, kvh, sq, skv, d, jnp.bfloat16,
                                                     rate, False) is None):
      print(f"{label}: skipped ({why})", flush=True)
      continue
    sets = run.input_sets(lambda key: run._a_inputs(dims, rate, key), i)
    floor_us = run._a_floor(w, c) / (ceiling["TBps"] * 1e6)
    refs = xla(*sets[0])
    fns = {"triton": triton}
    if why:   # a ragged workload: the ragged variants only
      fns.update(ragged_fns(rate, ragged, args.parts))
    else:
      for v in args.variants.split(","):
        if v not in RAGGED_VARIANTS:
          fns[v] = mosaic_fn(v, rate)
          if args.parts:
            fns[v + ":delta"], fns[v + ":ds_dv"] = parts_fns(v, rate)
    rows.append(variants_table.check_and_time(label, w, floor_us, fns, sets, refs,
                                              calls=args.calls,
                                              checked=lambda name: ":" not in name))
  names = ["triton", *args.variants.split(",")]
  if args.parts:
    names += ["triton:dv", "ragged:delta", "ragged:ds", "ragged:ds_dv"]
  variants_table.print_table(rows, names)
  with open(os.path.join(args.out, "a_mosaic_variants.json"), "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "ceiling": ceiling, "rows": rows}, f,
              indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
