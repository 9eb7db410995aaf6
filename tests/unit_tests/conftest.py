"""Fixtures shared by the single-process tests."""

import pytest

from megatron.training.initialize import initialize_distributed


@pytest.fixture(scope="module")
def runtime():
    """The one-process gloo group the in-process Trainer tests run in."""
    return initialize_distributed("gloo")


@pytest.fixture(autouse=True)
def _lm_eval_logs_to_this_tests_stderr():
    """lm-eval's `setup_logging` binds one StreamHandler to whatever sys.stderr was when its first
    evaluation ran (in a test: that test's capture, closed afterwards); a later test's lm-eval log
    line would then print a "Logging error" traceback. Point those handlers at the current stderr."""
    import logging
    import sys

    for handler in logging.getLogger("lm_eval").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.stream = sys.stderr  # not setStream: it flushes the old, perhaps closed, stream
    yield
