"""``python -m pallas_kernels.check``: on a CPU, ``--quick`` runs every op's kernel entry point
and forward plus backward in the Pallas interpreter, prints a pass row for each and exits 0;
a wrong kernel fails its rows and makes it exit 1."""

import os
import subprocess
import sys

import jax.numpy as jnp

import pallas_kernels
from conftest import ON_GPU
from pallas_kernels import check, workloads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRIES = ("kernel", "op fwd+bwd")


def rows(out):
  """``{(op, entry): [check, ...]}`` of the table's rows."""
  found = {}
  for line in out.splitlines():
    parts = line.split()
    if parts and parts[0] in workloads.OPS:
      entry = "kernel" if parts[1] == "kernel" else " ".join(parts[1:3])
      found.setdefault((parts[0], entry), []).append(
          next(p for p in parts if p in ("pass", "FAIL")))
  return found


def assert_all_pass(out):
  found = rows(out)
  assert set(found) == {(op, e) for op in workloads.OPS for e in ENTRIES}, out
  n_quick = {op: len(workloads.problem(op, quick=True)[1])
             + (len(workloads.problem(op, quick=True, causal=True)[1]) if op == check.CAUSAL else 0)
             for op in workloads.OPS}
  for (op, entry), checks in found.items():
    assert checks == ["pass"] * n_quick[op], (op, entry, out)


def test_quick_passes_every_op_and_entry(capsys):
  assert check.main(["--quick"]) == 0
  out = capsys.readouterr().out
  assert_all_pass(out)
  assert ("heuristic" in out) if not ON_GPU else ("tables:" in out)
  assert "cases pass" in out and "FAIL" not in out
  # Odd and non-power-of-two lengths are among the quick shapes.
  assert "37x67" in out and "45x45" in out and "33x33" in out and "causal" in out


def test_a_wrong_kernel_fails_and_exits_non_zero(monkeypatch, capsys):
  entry = pallas_kernels.qk_scale_softmax_backward
  def wrong(*args, **kwargs):
    d_q, d_k = entry(*args, **kwargs)
    return d_q * 1.5, d_k
  monkeypatch.setattr(pallas_kernels, "qk_scale_softmax_backward", wrong)
  assert check.main(["--quick", "--op", "qk_scale_softmax"]) == 1
  out = capsys.readouterr().out
  found = rows(out)
  assert set(found) == {("qk_scale_softmax", e) for e in ENTRIES}
  assert set(found["qk_scale_softmax", "kernel"]) == {"FAIL"}
  assert set(found["qk_scale_softmax", "op fwd+bwd"]) == {"pass"}  # the op has its own path
  assert "d_query" in out and "FAIL" in out.splitlines()[-1]


def test_a_case_that_raises_fails(monkeypatch, capsys):
  def broken(*args, **kwargs):
    raise RuntimeError("no kernel today")
  monkeypatch.setattr(pallas_kernels, "masked_softmax_dropout_backward", broken)
  assert check.main(["--quick", "--op", "masked_softmax_dropout"]) == 1
  out = capsys.readouterr().out
  assert "RuntimeError: no kernel today" in out
  assert set(rows(out)["masked_softmax_dropout", "kernel"]) == {"FAIL"}


def test_the_op_comparison_fails_on_wrong_gradients():
  ref = jnp.linspace(-1.0, 1.0, 1000, dtype=jnp.bfloat16)
  (_, good, _, _), = check.op_checks([ref], [ref], ["d"])
  (_, bad, _, _), = check.op_checks([ref * 1.2], [ref], ["d"])
  assert good["ok"] and not bad["ok"]


def test_the_module_runs_as_a_command():
  env = dict(os.environ, PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-m", "pallas_kernels.check", "--quick", "--op",
                        "masked_softmax_dropout"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=300)
  assert out.returncode == 0, out.stdout + out.stderr
  assert rows(out.stdout) == {("masked_softmax_dropout", e): ["pass", "pass"] for e in ENTRIES}
  bad = subprocess.run([sys.executable, "-m", "pallas_kernels.check", "--op", "nope"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
  assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_workloads_ship_with_the_package():
  """The check reads its workloads from the package (no benchmarks/ folder needed)."""
  assert os.path.dirname(workloads.PATH) == os.path.dirname(pallas_kernels.__file__)
  for op in workloads.OPS:
    constants, ws = workloads.problem(op)
    assert len(ws) == 16 and constants
    assert all({"atol", "rtol"} <= set(w) for w in ws)
