"""Test-session setup. Where Triton is installed but there is no GPU, Triton kernels (the fused loss's)
run under Triton's interpreter on CPU tensors. triton.jit reads TRITON_INTERPRET when triton is first
imported (torch._dynamo imports it), so it is set here, before any test module imports torch's compiler.
Without Triton the environment is left alone.
Each test runs with logging, os.environ and the deterministic switch restored after it (pytest_runtest_protocol below).
Without CUDA, torch.compile defaults to the aot_eager backend except in tests marked `inductor`
(tests/cpu_compile.py says why). Process groups a test creates are destroyed after it (_process_groups_released).

The `gpu` mark is the one way a test says it needs CUDA: a marked test skips where there is no CUDA
device, so `pytest -m gpu tests` on a GPU machine runs every CUDA path (tests/gpu/ holds the GPU parity
suite; the CUDA cases of the unit tests are marked where they live). Without CUDA, a test that skips
for a reason naming CUDA or a GPU but is not marked is an error, and so is a module that skips whole
for that reason: either would be missing from `pytest -m gpu`."""

import importlib.util
import logging
import os
import random
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.cpu_compile import use_inductor, use_test_backend  # noqa: E402

use_test_backend()  # without CUDA: aot_eager, unless a test is marked inductor (tests/cpu_compile.py)


# Every process group a test creates (each Trainer's ParallelState makes a dozen, even in one process), so
# that it is destroyed after the test: each gloo group keeps three threads, and hundreds of them left behind
# slowed the rest of the suite by several times.
_created_groups = []
_new_group = dist.new_group


def _recording_new_group(*args, **kwargs):
    group = _new_group(*args, **kwargs)
    _created_groups.append(group)
    return group


dist.new_group = _recording_new_group


@pytest.fixture(autouse=True)
def _process_groups_released():
    """The groups created during the test (not those of module fixtures, set up before it) are destroyed."""
    start = len(_created_groups)
    yield
    created = _created_groups[start:]
    del _created_groups[start:]
    if not dist.is_initialized():
        return  # gone with the default group (a run that owned it destroyed it)
    for group in created:
        if isinstance(group, dist.ProcessGroup):
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):  # already destroyed, or of a default group since replaced
                pass


@pytest.fixture(autouse=True)
def _inductor_where_marked(request):
    """A test marked `inductor` compiles with inductor (its C++ code generation on CPU)."""
    if request.node.get_closest_marker("inductor") is None:
        yield
        return
    use_inductor()
    try:
        yield
    finally:
        use_test_backend()


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
    """No test leaves logging, the environment, the CPU random generators (Python's, numpy's, torch's: the
    trainer seeds them all), oneDNN's switch (a CPU float8 run turns it off) or torch's deterministic-algorithms
    switch altered for the tests after it. lm-eval's `simple_evaluate` adds a
    StreamHandler bound to the sys.stderr of the moment (a test's capture, closed once the test ends)
    to its non-propagating logger; pytest attaches its own capture handlers to non-propagating loggers
    for each phase, so a handler left behind by one test would break every later test's logging.
    This wraps all three phases, outside pytest's per-phase log capture."""
    state, environment = _logging_state(), dict(os.environ)
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    generators = random.getstate(), np.random.get_state(), torch.get_rng_state()
    mkldnn = torch.backends.mkldnn.enabled
    yield
    random.setstate(generators[0])
    np.random.set_state(generators[1])
    torch.set_rng_state(generators[2])
    torch.backends.mkldnn.enabled = mkldnn
    _restore_logging(state)
    # --deterministic-mode sets both for the process (initialize.set_deterministic_mode): not for the next test
    torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    os.environ.clear()
    os.environ.update(environment)


CUDA_REASON = re.compile(r"cuda|gpu", re.IGNORECASE)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip where there is no CUDA device (the mark alone says a test needs CUDA)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu: `pytest -m gpu tests` runs it on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _skip_reason(report) -> str:
    """The message of a skipped report (pytest keeps it as (path, line, message))."""
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Without CUDA, a skip whose reason names CUDA or a GPU fails unless the test is marked `gpu`."""
    report = (yield).get_result()
    if not report.skipped or hasattr(report, "wasxfail"):  # an expected failure is no skip
        return
    if torch.cuda.is_available() or item.get_closest_marker("gpu") is not None:
        return
    reason = _skip_reason(report)
    if CUDA_REASON.search(reason):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} skips for lack of CUDA ({reason}) but is not marked gpu, so "
                           "`pytest -m gpu tests` leaves it out: mark it @pytest.mark.gpu (or its CUDA "
                           "parameter pytest.param(..., marks=pytest.mark.gpu)) instead of skipping")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """Without CUDA, a module that skips whole for lack of CUDA is an error: its tests would be
    missing from `pytest -m gpu`; a module-level `pytestmark = pytest.mark.gpu` keeps them listed."""
    report = (yield).get_result()
    if report.skipped and not torch.cuda.is_available() and CUDA_REASON.search(_skip_reason(report)):
        report.outcome = "failed"
        report.longrepr = (f"{collector.nodeid} skips whole for lack of CUDA ({_skip_reason(report)}): "
                           "use `pytestmark = pytest.mark.gpu` so that `pytest -m gpu tests` lists its tests")
