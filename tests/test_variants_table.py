"""The variant scripts' table (``benchmarks/variants_table.py``): a variant that missed the
tolerance is marked and left out of its geomean."""

from benchmarks import variants_table


def test_failed_variant_is_marked_and_not_averaged(capsys):
  rows = [{"workload": "8, 128, 128", "floor_us": 10.0, "triton": 20.0, "fast": 5.0,
           "failed": ["fast"]},
          {"workload": "32, 128, 128", "floor_us": 40.0, "triton": 50.0, "fast": 44.0,
           "failed": []}]
  variants_table.print_table(rows, ["triton", "fast"])
  out = capsys.readouterr().out
  assert "| 8, 128, 128 | 10.0 | 50.0% (20) | 200.0% (5) FAIL |" in out
  assert "| 32, 128, 128 | 40.0 | 80.0% (50) | 90.9% (44) |" in out
  assert "geomean fast: 90.9% over 1" in out
  assert "geomean triton: 63.2% over 2" in out
