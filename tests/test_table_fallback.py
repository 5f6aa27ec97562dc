"""Which tuned tables serve a device: its own, else those of its architecture, else none."""

import dataclasses
import json
import os

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
  assert _tuning.measured_kinds() == {"NVIDIA H200": "9.0"}


def test_a_shipped_device_has_every_kernels_table():
  """A device with package tables of its own reads only its own (no fallback per kernel), so
  a folder missing one kernel's table would send that kernel to the heuristics there."""
  kernels = {c.KERNEL + ".json" for c in (attention_config, masked_config, qk_config)}
  folders = sorted(os.listdir(_tuning.TUNED_DIR))
  assert folders
  for folder in folders:
    assert kernels <= set(os.listdir(os.path.join(_tuning.TUNED_DIR, folder))), folder


def test_a_device_takes_its_own_tables_then_its_architectures_then_none():
  assert _tuning.table_kind(FakeHopper()) == "NVIDIA H200"
  assert _tuning.table_source(FakeHopper()) == "package"
  assert _tuning.table_kind(FakeH100()) == "NVIDIA H200"
  assert _tuning.table_source(FakeH100()) == "fallback: NVIDIA H200"
  for other in (FakeBlackwell(), FakeA100()):
    assert _tuning.table_kind(other) == other.device_kind
    assert _tuning.table_source(other) == "heuristic"
  assert _tuning.table_kind(None) is None


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


@pytest.mark.parametrize("make_config", [
    lambda kind: masked_config.default_config(1024, 1024, kind),
    lambda kind: qk_config.default_config(1024, 1024, 128, jnp.bfloat16, kind),
    lambda kind: attention_config.default_config(4, 80, 8, 211, 293, 128, jnp.bfloat16, kind),
], ids=["masked_softmax_dropout", "qk_scale_softmax", "attention_softmax_dropout_value"])
def test_an_h100_runs_the_h200_configs_and_a_b200_the_heuristic(make_config):
  h200 = make_config("NVIDIA H200")
  assert h200 != make_config(None)  # the table is not the heuristic there
  assert make_config(_tuning.table_kind(FakeH100())) == h200
  assert make_config(_tuning.table_kind(FakeBlackwell())) == make_config(None)
