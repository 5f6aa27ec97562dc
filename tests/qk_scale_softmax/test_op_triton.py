"""The qk_scale_softmax base suite on the ``"triton"`` backend."""

import pytest

from .op_base import *  # noqa: F401,F403


@pytest.fixture
def implementation():
  return "triton"
