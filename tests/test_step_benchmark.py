"""The training-step benchmark's pieces (``benchmarks/step.py``) on tiny shapes: the step
function gives the same loss and gradients on the XLA and the Pallas path (the Pallas
kernels in the interpreter off a GPU), and the report and chart write."""

import jax
import numpy as np
import pytest

from benchmarks import step


@pytest.mark.parametrize("make", [
    lambda: step.attention_step(1, 16, h=4, kvh=2, d=16),
    lambda: step.masked_step(1, 2, 8),
    lambda: step.qk_step(1, 2, 8, d=16),
    lambda: step.qk_step(1, 2, 8, d=16, causal=True),
])
def test_step_fn_same_on_both_paths(make):
  s = make()
  primals, w = s.make(jax.random.key(0))
  rng = jax.random.key(1)
  (loss_x, grads_x) = step.step_fn(s, "xla")(primals, w, rng)
  # The Pallas path as the benchmark times it (the default), in the interpreter off a GPU.
  on_gpu = jax.default_backend() == "gpu"
  impl = None if on_gpu else "pallas"
  (loss_p, grads_p) = step.step_fn(s, impl, interpret=not on_gpu)(primals, w, rng)
  np.testing.assert_allclose(float(loss_p), float(loss_x), rtol=1e-2, atol=1e-2)
  for gx, gp in zip(jax.tree.leaves(grads_x), jax.tree.leaves(grads_p)):
    assert gx.shape == gp.shape
    scale = float(np.abs(np.asarray(gx, np.float32)).max()) + 1e-6
    np.testing.assert_allclose(np.asarray(gp, np.float32), np.asarray(gx, np.float32),
                               atol=2e-2 * scale, rtol=5e-2)
  compiled = step.step_fn(s, "xla").lower(primals, w, rng).compile()
  assert step.temp_mb(compiled) > 0
  np.testing.assert_allclose(float(compiled(primals, w, rng)[0]), float(loss_x))
  # The forward alone is another XLA program: on a GPU its fusions may round the 16-bit P
  # elsewhere than the step's (qk_scale_softmax's loss moved by 0.8% on an H100), so the
  # loss is compared as the paths are.
  np.testing.assert_allclose(float(step.forward_fn(s)(primals, w, rng)), float(loss_x),
                             rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(float(step.forward_fn(s, impl, not on_gpu)(primals, w, rng)),
                             float(loss_p), rtol=1e-2, atol=1e-2)


def test_report_and_chart(tmp_path):
  rows = [{"op": step.ATTENTION, "step": "attention_softmax_dropout_value, B=2 S=2048 (H=80, "
           "KVH=8, D=128)",
           "xla_us": 6000.0, "pallas_us": 3000.0, "speedup": 2.0, "xla_temp_mb": 4480.0,
           "pallas_temp_mb": 2112.0, "split_ok": True},
          {"op": step.QK, "step": "qk_scale_softmax, B=32 H=32 S=128",
           "xla_us": 500.0,
           "pallas_us": 400.0, "speedup": 1.25, "xla_temp_mb": 10.0, "pallas_temp_mb": 9.0,
           "split_ok": True}]
  meta = {"date": "2026-12-01", "device": "NVIDIA H200", "jax": "0.11.2", "commit": "abc",
          "calls": 20}
  text = step.markdown(meta, rows)
  assert ("| attention_softmax_dropout_value, B=2 S=2048 (H=80, KVH=8, D=128) | 6000 | 3000 | "
          "2.00x | - | 4480 / 2112 |") in text
  rows[0]["forward_us"] = 2500.0
  assert "| 2.00x | 2500 | 4480 / 2112 |" in step.markdown(meta, rows)
  rows[0]["pallas_forward_us"] = 1200.0
  assert "| 2.00x | 2500 / 1200 | 4480 / 2112 |" in step.markdown(meta, rows)
  assert "| qk_scale_softmax, B=32 H=32 S=128 | 500 | 400 | 1.25x | - | 10 / 9 |" in text
  png = step.write_chart(rows, str(tmp_path / "step.png"))
  if png is not None:
    assert (tmp_path / "step.png").stat().st_size > 1000


def test_needs_a_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU the benchmark runs")
  assert step.main(["--out", "/nonexistent", "--op", step.QK]) == 2
