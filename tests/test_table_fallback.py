"""Which tuned tables serve a device: its own, else those of its architecture, else none."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from conftest import FakeBlackwell, FakeHopper
from pallas_kernels import _tuning
from pallas_kernels.attention_softmax_dropout_value import config as attention_config
from pallas_kernels.masked_softmax_dropout import config as masked_config
from pallas_kernels.qk_scale_softmax import config as qk_config


class FakeH100(FakeHopper):
  device_kind = "NVIDIA H100 80GB HBM3"


class FakeA100(FakeHopper):
  compute_capability = "8.0"
  device_kind = "NVIDIA A100-SXM4-80GB"


@pytest.fixture
def tables(tmp_path, monkeypatch):
  """Writes tables ``{folder: (device kind, compute capability)}`` under ``tmp_path``."""
  monkeypatch.setattr(_tuning, "TUNED_DIR", str(tmp_path))

  def write(**folders):
    for folder, (kind, cap) in folders.items():
      (tmp_path / folder).mkdir()
      data = {"device_kind": kind, "compute_capability": cap, "configs": {}}
      (tmp_path / folder / "masked_softmax_dropout.json").write_text(json.dumps(data))
    _tuning.measured_kinds.cache_clear()
  yield write
  _tuning.measured_kinds.cache_clear()
  _tuning.table.cache_clear()


def test_the_package_tables_record_their_architecture():
  assert _tuning.measured_kinds() == {"NVIDIA H100 80GB HBM3": "9.0", "NVIDIA H200": "9.0"}


def test_a_device_takes_its_own_tables_then_its_architectures_then_none():
  assert _tuning.table_kind(FakeHopper()) == "NVIDIA H200"
  assert _tuning.table_source(FakeHopper()) == "package"
  assert _tuning.table_kind(FakeH100()) == "NVIDIA H100 80GB HBM3"
  assert _tuning.table_source(FakeH100()) == "package"
  for other in (FakeBlackwell(), FakeA100()):
    assert _tuning.table_kind(other) == other.device_kind
    assert _tuning.table_source(other) == "heuristic"
    assert _tuning.table_source(other, qk_config.KERNEL) == "heuristic"
  assert _tuning.table_kind(None) is None


def test_a_kernel_without_a_table_of_the_device_takes_its_architectures():
  """The H100 ships tables of qk_scale_softmax and attention_softmax_dropout_value: it reads
  the H200's masked_softmax_dropout table."""
  for kernel in (qk_config.KERNEL, attention_config.KERNEL):
    assert _tuning.table_source(FakeH100(), kernel) == "package"
  kernel = masked_config.KERNEL
  assert _tuning.table_source(FakeH100(), kernel) == "fallback: NVIDIA H200"
  assert _tuning.table_source(FakeHopper(), kernel) == "package"
  assert _tuning.table(kernel, "NVIDIA H100 80GB HBM3") == _tuning.table(kernel, "NVIDIA H200")


def _write(path, kind, configs):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"device_kind": kind, "compute_capability": "9.0",
                              "jax": jax.__version__, "configs": configs}))
  _tuning.clear_caches()


def test_a_kernels_table_is_one_devices_with_the_user_caches_classes_ahead(tmp_path, monkeypatch):
  """A device's own table of a kernel serves it whole (the architecture's other tables fill
  no class it lacks: their classes could carry another device's "xla" choice, or beat its own
  nearest-ragged class); the user cache's classes come first."""
  monkeypatch.setattr(_tuning, "TUNED_DIR", str(tmp_path))
  monkeypatch.setenv(_tuning.CACHE_ENV, str(tmp_path / "cache"))
  kernel, h100, h200 = masked_config.KERNEL, "NVIDIA H100 80GB HBM3", "NVIDIA H200"
  mine, theirs, other = ({"target": t, "num_warps": 4, "split": False} for t in (256, 512, 1024))
  _write(tmp_path / "nvidia_h200" / f"{kernel}.json", h200, {"256": theirs, "512": theirs})
  _write(tmp_path / "nvidia_h200" / f"{qk_config.KERNEL}.json", h200, {"128": theirs})
  _write(tmp_path / "nvidia_h100_80gb_hbm3" / f"{kernel}.json", h100, {"256": mine})
  try:
    assert _tuning.table(kernel, h100) == {"256": mine}
    assert _tuning.table(kernel, h200) == {"256": theirs, "512": theirs}
    assert _tuning.table(qk_config.KERNEL, h100) == {"128": theirs}  # no H100 table of it
    assert _tuning.table_source(FakeH100(), qk_config.KERNEL) == "fallback: NVIDIA H200"
    _write(tmp_path / "cache" / jax.__version__ / "nvidia_h100_80gb_hbm3" / f"{kernel}.json",
           h100, {"512": other})  # the user cache's classes come first
    assert _tuning.table(kernel, h100) == {"256": mine, "512": other}
    assert _tuning.table_source(FakeH100(), kernel) == "user cache"
  finally:
    _tuning.clear_caches()


def test_the_nearest_name_of_the_architecture_wins(tables):
  tables(h100=("NVIDIA H100 80GB HBM3", "9.0"), h200=("NVIDIA H200", "9.0"),
         b200=("NVIDIA B200", "10.0"))
  h100_pcie = dataclasses.make_dataclass("H100PCIe", [], bases=(FakeHopper,))
  h100_pcie.device_kind = "NVIDIA H100 PCIe"
  assert _tuning.table_kind(h100_pcie()) == "NVIDIA H100 80GB HBM3"
  assert _tuning.table_kind(FakeHopper()) == "NVIDIA H200"
  assert _tuning.table_kind(FakeH100()) == "NVIDIA H100 80GB HBM3"
  assert _tuning.table_kind(FakeBlackwell()) == "NVIDIA B200"
  assert _tuning.table_kind(FakeA100()) == FakeA100.device_kind


def test_a_table_without_its_architecture_serves_only_its_own_kind(tables):
  tables(h200=("NVIDIA H200", None))
  assert _tuning.table_kind(FakeH100()) == "NVIDIA H100 80GB HBM3"
  assert _tuning.table_source(FakeH100()) == "heuristic"


@pytest.mark.parametrize("make_config,own", [
    (lambda kind: masked_config.default_config(1024, 1024, kind), False),
    (lambda kind: qk_config.default_config(256, 256, 128, jnp.bfloat16, kind), True),
    (lambda kind: attention_config.default_config(4, 80, 8, 211, 293, 128, jnp.bfloat16, kind),
     False),
], ids=["masked_softmax_dropout", "qk_scale_softmax", "attention_softmax_dropout_value"])
def test_an_h100_runs_its_configs_or_the_h200s_and_a_b200_the_heuristic(make_config, own):
  h200 = make_config("NVIDIA H200")
  assert h200 != make_config(None)  # the table is not the heuristic there
  h100 = make_config(_tuning.table_kind(FakeH100()))
  assert (h100 != h200) if own else (h100 == h200)
  assert make_config(_tuning.table_kind(FakeBlackwell())) == make_config(None)
