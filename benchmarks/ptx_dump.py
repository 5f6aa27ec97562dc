"""The PTX that XLA compiles for kernel B's entry point, and what ``ptxas -v`` says of it, per
config, on a GPU: which loads and stores the kernel issues (vector width, cache hints) and how
many registers it takes.

Usage::

    PYTHONPATH=. python3 -m benchmarks.ptx_dump --out DIR [--shape 4,4,4096] [--p 0.1]
        [--configs default,1/16/pub]   # benchmarks.b_backward_sweep's launch names

For each config it compiles the kernel with ``--xla_dump_to`` in a fresh subprocess, keeps
the dumped PTX (``<out>/<name>/``) and prints a count of each distinct ``ld.global`` /
``st.global`` form, then ``ptxas -v``'s register line when a ``ptxas`` is found (``PATH``,
or the CUDA wheels beside jax). With jax 0.11.2 XLA dumps no PTX or LLVM IR for a Triton
custom call: the script then lists what it dumped, including the GPU executable's riegeli
file (snappy-compressed records, not decoded here).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys

from benchmarks.timing import no_gpu

_CHILD = r"""
import sys
import jax, jax.numpy as jnp
from benchmarks.b_backward_sweep import parse_launch
from pallas_kernels.masked_softmax_dropout import default_config, pallas_triton
b, h, s = map(int, sys.argv[1].split(","))
p, name = float(sys.argv[2]), sys.argv[3]
config = (default_config(s, s, jax.devices()[0].device_kind) if name == "default"
          else parse_launch(name))
print("config:", config)
k = jax.random.split(jax.random.key(0), 4)
g = jax.random.normal(k[0], (b, h, s, s), jnp.float32)
probs = jax.nn.softmax(jax.random.normal(k[1], (b, h, s, s)), axis=-1)
mask = jax.random.bernoulli(k[2], 0.9, (b, 1, s, s))
keep = jax.random.bernoulli(k[3], 1 - p, (b, h, s, s))
out = pallas_triton.masked_softmax_dropout_backward(g, probs, mask, keep, p, config=config)
jax.block_until_ready(out)
"""


def _ptxas():
  found = shutil.which("ptxas")
  if found:
    return found
  import jax
  root = os.path.dirname(os.path.dirname(jax.__file__))
  hits = glob.glob(os.path.join(root, "nvidia", "**", "bin", "ptxas"), recursive=True)
  return hits[0] if hits else None


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--shape", default="4,4,4096")
  parser.add_argument("--p", type=float, default=0.1)
  parser.add_argument("--configs", default="default")
  args = parser.parse_args(argv)
  if no_gpu("dumping the kernel's PTX", "nothing compiled"):
    return 2
  ptxas = _ptxas()
  print("ptxas:", ptxas)
  for name in args.configs.split(","):
    tag = name.replace("/", "_")
    dump = os.path.join(args.out, tag)
    os.makedirs(dump, exist_ok=True)
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump} --xla_gpu_dump_llvmir=true "
               "--xla_gpu_experimental_dump_gpu_executable=true")
    run = subprocess.run([sys.executable, "-c", _CHILD, args.shape, str(args.p), name],
                         env=env, capture_output=True, text=True)
    print(f"== {name}: {run.stdout.strip()} rc={run.returncode}")
    if run.returncode:
      print(run.stderr[-2000:])
      continue
    # The kernel's module is jit__call's (XLA names the kernel after the HLO instruction).
    paths = [p for ext in ("ptx", "ll")
             for p in glob.glob(os.path.join(dump, "**", f"*.{ext}"), recursive=True)]
    print("  dumped:", sorted(os.path.basename(p) for p in paths))
    # The executable (--xla_gpu_experimental_dump_gpu_executable) is written as riegeli
    # records (snappy-compressed); it is left for offline decoding.
    calls = glob.glob(os.path.join(dump, "**", "*jit__call*.riegeli"), recursive=True)
    print("  executable dumps:", sorted(os.path.basename(p) for p in calls))
    for path in sorted(p for p in paths if "jit__call" in p):
      text = open(path).read()
      forms = collections.Counter(re.findall(r"(?:ld|st)\.global[\w.:]*", text))
      print(f"  {os.path.basename(path)}:")
      for form, n in sorted(forms.items()):
        print(f"    {n:3d}  {form}")
      if ptxas and path.endswith(".ptx"):
        arch = re.search(r"\.target\s+(\S+)", text)
        sm = arch.group(1).rstrip(",") if arch else "sm_90a"
        res = subprocess.run([ptxas, "-v", f"-arch={sm}", path, "-o", os.devnull],
                             capture_output=True, text=True)
        for line in (res.stdout + res.stderr).splitlines():
          if "registers" in line or "spill" in line or "error" in line.lower():
            print("   ", line.strip())
  return 0


if __name__ == "__main__":
  sys.exit(main())
