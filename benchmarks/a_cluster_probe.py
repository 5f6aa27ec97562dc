"""Where the time of kernel A's cluster mode (``Config(cluster_delta=True)``) goes: the
one-kernel dS-dV launch timed with parts of its per-step delta exchange left out.

Usage (on a Hopper GPU)::

    PYTHONPATH=. python3 -m benchmarks.a_cluster_probe [--workloads 14,11] [--calls 20]

Variants (each replaces ``pallas_mosaic_gpu._exchange_delta`` while the kernel is traced):
``full`` (the kernel as shipped), ``noread`` (the mbarrier handshake, no read of the peers'
parts: delta is this warpgroup's own part), ``nosync`` (no handshake and no read: only the
local write), against the default path. ``noread`` and ``nosync`` compute wrong gradients
(timing probes, not checked). Prints one table. (At 7bd5ad4 the exchange ordered its
writes and reads with ``fence.acq_rel.cluster`` around a cluster barrier; the probe then
also timed it without either fence, or with one: ``runs/a_cluster_probe_7bd5ad4.log``.)
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks import run, variants_table
from jax_ops import reference
from pallas_kernels import _mosaic
from pallas_kernels.attention_softmax_dropout_value import pallas_mosaic_gpu as mg

SHIPPED = mg._exchange_delta


def probe_exchange(sync: bool, read: bool):
  """The shipped exchange with its handshake (``sync``: the mbarrier arrivals and waits)
  and its reads of the peers' parts (``read``) left out as asked."""
  def exchange(part, xchg_smem, mbar, xchg_barrier, xg_ref, step, kb, wg, program, *,
               cluster, interpret):
    slot = lax.rem(step, 2)
    for s in range(2):
      for w in range(mg.WGS):
        @pl.when((slot == s) & (wg == w))
        def _write():
          xchg_smem[s * mg.WGS + w][...] = part
    if sync:
      plgpu.commit_smem()
      for s in range(2):
        @pl.when(slot == s)
        def _arrive():
          _mosaic.cluster_barrier_arrive(mbar, s, cluster)
      phase = lax.rem(step, 4)
      for q in range(4):
        @pl.when(phase == q)
        def _wait():
          _mosaic.cluster_barrier_wait(mbar, q % 2, q // 2)
    if not read:
      return part
    rd = lambda s: _mosaic.cluster_sum(xchg_smem[s * mg.WGS:(s + 1) * mg.WGS], cluster)
    return lax.cond(slot == 0, lambda: rd(0), lambda: rd(1))
  return exchange


# name -> probe_exchange's arguments (sync, read)
PROBES = {"noread": (True, False), "nosync": (False, False)}


def probe_fn(name, rate, split="auto"):
  config = mg.Config(cluster_delta=True, split=split)

  def fn(*a):
    mg._exchange_delta = SHIPPED if name == "full" else probe_exchange(*PROBES[name])
    try:
      return mg._backward(*a[:4], rate=rate, config=config, interpret=False)
    finally:
      mg._exchange_delta = SHIPPED
  return jax.jit(fn)


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--workloads", default="14,11")
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--probes", default=",".join(PROBES))
  parser.add_argument("--split", default="auto",
                      help="the cluster variants' Config.split ('auto' or an int)")
  args = parser.parse_args(argv)
  spec, idx, ceiling = variants_table.setup("attention_softmax_dropout_value_backward",
                                            args.workloads)
  c = spec["constants"]
  rate = c["attention_dropout"]
  xla = jax.jit(lambda *a: reference.attention_softmax_dropout_value_backward_reference(*a, rate))
  default = jax.jit(lambda *a: mg._backward(*a[:4], rate=rate, config=mg.Config(),
                                            interpret=False))
  names = ["default", "full", *args.probes.split(",")]
  rows = []
  for i in idx:
    w = spec["workloads"][i]
    dims = run._a_dims(w, c)
    sets = run.input_sets(lambda key: run._a_inputs(dims, rate, key), i)
    floor_us = run._a_floor(w, c) / (ceiling["TBps"] * 1e6)
    split = args.split if args.split == "auto" else int(args.split)
    fns = {"default": default} | {n: probe_fn(n, rate, split) for n in names[1:]}
    rows.append(variants_table.check_and_time(
        run.PROBLEM_A.label(w), w, floor_us, fns, sets, xla(*sets[0]), calls=args.calls,
        checked=lambda name: name in ("default", "full")))
  variants_table.print_table(rows, names)
  return 0


if __name__ == "__main__":
  sys.exit(main())
