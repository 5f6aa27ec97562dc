"""The packages' import rules (scripts/import_graph.py): no cycles, pallas_kernels never imports
jax_ops, and the ops reach backend files only through the registry."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
import import_graph  # noqa: E402


def test_import_rules_hold():
  g = import_graph.graph()
  assert "jax_ops.ops.attention_softmax_dropout_value.pallas_triton" in g and "pallas_kernels.validation" in g
  assert import_graph.cycles(g) == []
  assert not [d for m, ds in g.items() if m.startswith("pallas_kernels") for d in ds
              if d.startswith("jax_ops")]
  assert not [(m, d) for m, ds in g.items() if m.startswith("jax_ops") and not
              import_graph.is_backend(m) for d in ds if import_graph.is_backend(d)]
  assert import_graph.cross_op_edges(g) == []


def test_the_checks_can_fail():
  assert import_graph.cycles({"a": {"b"}, "b": {"a"}})
  assert import_graph.is_backend("jax_ops.ops.qk_scale_softmax.pallas_triton")
  assert not import_graph.is_backend("jax_ops.ops.qk_scale_softmax.api")
  assert import_graph.cross_op_edges(
      {"pallas_kernels.qk_scale_softmax.forward": {"pallas_kernels.attention_softmax_dropout_value.x",
                                                   "pallas_kernels._triton_tiles"}}) == [
      ("pallas_kernels.qk_scale_softmax.forward", "pallas_kernels.attention_softmax_dropout_value.x")]
