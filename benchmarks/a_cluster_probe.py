"""Where the time of kernel A's cluster mode (``Config(cluster_delta=True)``) goes: the
one-kernel dS-dV launch timed with parts of its per-step delta exchange left out.

Usage (on a Hopper GPU)::

    PYTHONPATH=. python3 -m benchmarks.a_cluster_probe [--workloads 14,11] [--calls 20]

Variants (each replaces ``pallas_mosaic_gpu._exchange_delta`` while the kernel is traced):
``full`` (the kernel as shipped), ``nofence`` (no ``fence.acq_rel.cluster``), ``noread``
(the barrier, no read of the peers' parts: delta is this warpgroup's own part),
``nosync`` (no barrier and no read: only the local write), against the default two-kernel
path; ``wfence`` / ``rfence``: only the writer's / the reader's fence; ``wait0``: the
step's dV GEMM waited for before the exchange (``wait0_wfence``: and the writer's fence
only). ``noread`` and ``nosync`` compute wrong gradients (timing probes, not checked); the
others are checked. Prints one table.
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


def probe_exchange(fence: bool, sync: bool, read: bool, *, reader_fence=None, wait0=False):
  reader_fence = fence if reader_fence is None else reader_fence

  def exchange(part, xchg_smem, xchg_barrier, xg_ref, slot, kb, wg, program, *, cluster,
               interpret):
    if wait0:   # the step's dV GEMM done before the exchange
      plgpu.wgmma_wait(0)
    for s in range(2):
      for w in range(mg.WGS):
        @pl.when((slot == s) & (wg == w))
        def _write():
          xchg_smem[s * mg.WGS + w][...] = part
    if fence:
      _mosaic.cluster_fence(False)
    if sync:
      plgpu.commit_smem()
      plgpu.barrier_arrive(xchg_barrier)
      plgpu.barrier_wait(xchg_barrier)
      if reader_fence:
        _mosaic.cluster_fence(False)
    if not read:
      return part
    rd = lambda s: _mosaic.cluster_sum(xchg_smem[s * mg.WGS:(s + 1) * mg.WGS], cluster)
    return lax.cond(slot == 0, lambda: rd(0), lambda: rd(1))
  return exchange


# name -> probe_exchange's arguments (fence, sync, read, then keywords)
PROBES = {"nofence": ((False, True, True), {}), "noread": ((True, True, False), {}),
          "nosync": ((False, False, False), {}),
          "wfence": ((True, True, True), dict(reader_fence=False)),
          "rfence": ((False, True, True), dict(reader_fence=True)),
          "wait0": ((True, True, True), dict(wait0=True)),
          "wait0_wfence": ((True, True, True), dict(wait0=True, reader_fence=False))}


def probe_fn(name, rate, split="auto"):
  config = mg.Config(cluster_delta=True, split=split)

  def fn(*a):
    if name == "full":
      mg._exchange_delta = SHIPPED
    else:
      flags, kw = PROBES[name]
      mg._exchange_delta = probe_exchange(*flags, **kw)
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
        checked=lambda name: name not in ("noread", "nosync")))
  variants_table.print_table(rows, names)
  return 0


if __name__ == "__main__":
  sys.exit(main())
