"""Launches kernel B's backward for Nsight Compute (``benchmarks/b_ncu.sh``): the library's
Pallas kernel at its default config and at the public row kernel's design (one row per
program, ``--pub-warps`` warps, g/P/keep ``.cg``, the mask ``.ca`` after the sum, an
evict-first store), then the plain Triton row kernel of ``benchmarks/b_triton_row.py``,
each ``--calls`` times inside a ``cudaProfilerStart/Stop`` range (after warm-up calls), so
``ncu --profile-from-start off`` sees those launches only. No timing here.

``--set smem0 [--names a,b]`` launches a ``benchmarks.b_variants`` set's configs instead of
those two.

Usage: ``PYTHONPATH=. python3 -m benchmarks.b_ncu_driver 4,4,4096,0.1 [--calls 2] [--set S]``
"""

from __future__ import annotations

import argparse
import os

import jax

from benchmarks import b_triton_row as row
from benchmarks.b_backward_sweep import DESIGNS
from benchmarks.timing import no_gpu
from pallas_kernels._util import next_power_of_2
from pallas_kernels.masked_softmax_dropout import Config, default_config, pallas_triton


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("workload", help="B,H,S,p")
  parser.add_argument("--calls", type=int, default=2)
  parser.add_argument("--pub-warps", type=int, default=16)
  parser.add_argument("--set", default=None,
                      help="instead of the two above: the configs of this benchmarks.b_variants "
                           "set (e.g. smem0), in its order; --names picks some")
  parser.add_argument("--names", default=None, help="comma-separated variant names of --set")
  args = parser.parse_args(argv)
  b, h, s, p = args.workload.split(",")
  # Torch and JAX share the GPU: JAX must not take 75% of it at its first use.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if no_gpu("launching kernel B's backward for Nsight Compute", "nothing launched"):
    return 2
  w = dict(batch_size=int(b), n_heads=int(h), seq_len=int(s), p_dropout=float(p))
  row._import_gpu_libs()
  torch = row.torch
  xs = row._make_inputs(w)(jax.random.key(0))
  jax.block_until_ready(xs)
  rate = w["p_dropout"]
  if args.set:
    from benchmarks import b_variants
    make, _ = b_variants.SETS[args.set]
    s = w["seq_len"]
    named = make(s, s, default_config(s, s, jax.devices()[0].device_kind))
    if args.names:
      named = {n: named[n] for n in args.names.split(",") if n in named}
    configs = list(named.values())
    labels = [f"{n} ({b_variants._label(c)})" for n, c in named.items()]
  else:
    configs = [None, Config(1, args.pub_warps, split=True, **DESIGNS["pub"])]
    labels = ["pallas default", f"pallas pub/{args.pub_warps}"]
  fns = [jax.jit(lambda g, probs, mask, *keep, c=c: pallas_triton.masked_softmax_dropout_backward(
      g, probs, mask, keep[0] if keep else None, rate, config=c)) for c in configs]
  ts = tuple(row._torch_view(x) for x in xs)
  out = torch.empty_like(ts[0])
  dims = (w["batch_size"], w["n_heads"], w["seq_len"])
  warps = row.auto_warps(next_power_of_2(w["seq_len"]))
  for _ in range(3):  # compile and warm up
    for fn in fns:
      jax.block_until_ready(fn(*xs))
    row._launch(dims, rate, ts, out, warps)
  torch.cuda.synchronize()
  torch.cuda.profiler.start()
  for fn in fns:
    for _ in range(args.calls):
      jax.block_until_ready(fn(*xs))
  for _ in range(args.calls):
    row._launch(dims, rate, ts, out, warps)
  torch.cuda.synchronize()
  torch.cuda.profiler.stop()
  print("launched, in this order: " + "; ".join(labels)
        + "; triton %d warps; %d calls each" % (warps, args.calls))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
