"""The op's base suite on the ``"xla"`` backend."""

import pytest

from .op_base import *  # noqa: F401,F403


@pytest.fixture
def implementation():
  return "xla"
