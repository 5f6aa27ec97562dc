"""The packages' import rules (scripts/import_graph.py): no cycles, pallas_kernels never imports
jax_ops but for its command-line tools (pallas_kernels.check, .tune), which no other module
imports, and the ops reach backend files only through the registry."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
import import_graph  # noqa: E402


def test_import_rules_hold():
  g = import_graph.graph()
  assert "jax_ops.ops.attention_softmax_dropout_value.pallas_triton" in g and "pallas_kernels.validation" in g
  assert import_graph.cycles(g) == []
  assert import_graph.jax_ops_imports(g) == []
  assert import_graph.tool_imports(g) == []
  assert not [(m, d) for m, ds in g.items() if m.startswith("jax_ops") and not
              import_graph.is_backend(m) for d in ds if import_graph.is_backend(d)]
  assert import_graph.cross_op_edges(g) == []
  assert import_graph.main() == 0


def test_the_check_is_the_tool_that_imports_jax_ops():
  """``pallas_kernels.check`` runs the ops (it imports jax_ops); the package's ``__init__``
  does not import it, nor does any other module; the shared workloads belong to no op."""
  g = import_graph.graph()
  assert import_graph.is_tool("pallas_kernels.check") and "pallas_kernels.check" in g
  assert {d for d in g["pallas_kernels.check"] if d.startswith("jax_ops")}
  assert "pallas_kernels.check" not in g["pallas_kernels"]
  assert not {d for d in g["pallas_kernels.workloads"] if d.startswith("jax_ops")}
  assert import_graph.op_of("pallas_kernels.workloads") is None
  assert import_graph.op_of("pallas_kernels.check") is None


def test_the_checks_can_fail():
  assert import_graph.cycles({"a": {"b"}, "b": {"a"}})
  assert import_graph.is_backend("jax_ops.ops.qk_scale_softmax.pallas_triton")
  assert not import_graph.is_backend("jax_ops.ops.qk_scale_softmax.api")
  assert import_graph.cross_op_edges(
      {"pallas_kernels.qk_scale_softmax.forward": {"pallas_kernels.attention_softmax_dropout_value.x",
                                                   "pallas_kernels._triton_tiles"}}) == [
      ("pallas_kernels.qk_scale_softmax.forward", "pallas_kernels.attention_softmax_dropout_value.x")]
  g = {"pallas_kernels._util": {"jax_ops.registry"},
       "pallas_kernels.check": {"jax_ops", "pallas_kernels.workloads"},
       "pallas_kernels.tune": {"jax_ops.reference", "pallas_kernels.check"},
       "pallas_kernels": {"pallas_kernels.check"}}
  assert import_graph.jax_ops_imports(g) == [("pallas_kernels._util", "jax_ops.registry")]
  # A tool may use another (the tuner times the op as the check builds it); nothing else may.
  assert import_graph.tool_imports(g) == [("pallas_kernels", "pallas_kernels.check")]
  assert import_graph.cycles({"pallas_kernels.tune": {"pallas_kernels.check"},
                              "pallas_kernels.check": {"pallas_kernels.tune"}})
