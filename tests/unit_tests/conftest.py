"""Fixtures shared by the single-process tests."""

import pytest

from megatron.training.initialize import initialize_distributed


@pytest.fixture(scope="module")
def runtime():
    """The one-process gloo group the in-process Trainer tests run in."""
    return initialize_distributed("gloo")

