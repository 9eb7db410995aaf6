"""Test-session setup. Where Triton is installed but there is no GPU, Triton kernels (the fused loss's)
run under Triton's interpreter on CPU tensors. triton.jit reads TRITON_INTERPRET when triton is first
imported (torch._dynamo imports it), so it is set here, before any test module imports torch's compiler.
Without Triton the environment is left alone.
Each test runs with logging, os.environ and the deterministic switch restored after it (pytest_runtest_protocol below)."""

import importlib.util
import logging
import os

import pytest
import torch

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _logging_state():
    """Each logger's handlers, level, propagate and disabled flag (the root logger's too)."""
    manager = logging.getLogger().manager
    loggers = [logging.getLogger()] + [lg for lg in manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    return {lg: (list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers}


def _restore_logging(state):
    """Put every logger back as `state` recorded it; a logger created since loses what was added to it."""
    manager = logging.getLogger().manager
    for lg in [logging.getLogger()] + list(manager.loggerDict.values()):
        if not isinstance(lg, logging.Logger):
            continue
        handlers, level, propagate, disabled = state.get(lg, ([], logging.NOTSET, True, False))
        lg.handlers[:] = handlers
        lg.propagate, lg.disabled = propagate, disabled
        lg.setLevel(level)  # setLevel also clears the loggers' cached levels


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """No test leaves logging, the environment or torch's deterministic-algorithms switch altered for
    the tests after it. lm-eval's `simple_evaluate` adds a
    StreamHandler bound to the sys.stderr of the moment (a test's capture, closed once the test ends)
    to its non-propagating logger; pytest attaches its own capture handlers to non-propagating loggers
    for each phase, so a handler left behind by one test would break every later test's logging.
    This wraps all three phases, outside pytest's per-phase log capture."""
    state, environment = _logging_state(), dict(os.environ)
    deterministic = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    _restore_logging(state)
    # --deterministic-mode sets both for the process (initialize.set_deterministic_mode): not for the next test
    torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    os.environ.clear()
    os.environ.update(environment)
