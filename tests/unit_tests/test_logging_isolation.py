"""No test leaves logging altered for the tests after it (tests/conftest.py restores it after each test).

lm-eval's `simple_evaluate` adds a StreamHandler bound to the sys.stderr of its moment (a test's capture)
to its own non-propagating logger. Left there, it writes into a closed capture in every later test, and
pytest (9.2 and later) attaches its per-phase capture handlers to that logger too, so anything that
rewires the logger's handlers breaks every later test at setup. This runs two tests in a child pytest
session with the project's conftest: the first configures lm-eval's logging as an evaluation does, the
second must find the logger as it was and log cleanly."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_TESTS = textwrap.dedent('''
    import logging

    def test_a_configures_lm_eval_logging():
        from lm_eval.utils import setup_logging
        setup_logging()
        logging.getLogger("lm_eval").info("from the first test")

    def test_b_finds_logging_as_it_was(caplog):
        handlers = logging.getLogger("lm_eval").handlers
        assert not [h for h in handlers if type(h) is logging.StreamHandler], handlers
        with caplog.at_level(logging.INFO, logger="lm_eval"):
            logging.getLogger("lm_eval").warning("from the second test")
        assert "from the second test" in caplog.text
''')


def _run_pair(tmp_path, tests: str) -> str:
    """Two tests in a child pytest session under the project's conftest; its output, asserting both passed."""
    shutil.copy(Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_pair.py").write_text(tests)
    root = str(Path(__file__).parents[2])  # the conftest imports tests.cpu_compile from the repository
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path})
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "2 passed" in out, out
    return out


def test_a_test_that_configures_lm_eval_logging_leaves_the_next_test_intact(tmp_path):
    pytest.importorskip("lm_eval")
    out = _run_pair(tmp_path, _TESTS)
    assert "Logging error" not in out, out


_GENERATOR_TESTS = textwrap.dedent('''
    import random

    import numpy as np
    import torch

    def test_a_records_the_generators_and_reseeds_them(tmp_path_factory):
        path = tmp_path_factory.getbasetemp() / "draws.txt"
        path.write_text(repr((random.random(), float(np.random.rand()), float(torch.rand(1)))))
        random.seed(7), np.random.seed(7), torch.manual_seed(7)
        torch.backends.mkldnn.enabled = not torch.backends.mkldnn.enabled

    def test_b_draws_what_the_first_drew(tmp_path_factory):
        first = (tmp_path_factory.getbasetemp() / "draws.txt").read_text()
        assert repr((random.random(), float(np.random.rand()), float(torch.rand(1)))) == first
        assert torch.backends.mkldnn.enabled == torch.backends.mkldnn.is_available()
''')


def test_a_test_that_seeds_the_generators_leaves_the_next_test_the_state_before_it(tmp_path):
    """The trainer seeds Python's, numpy's and torch's generators (and a CPU float8 run turns oneDNN off):
    the conftest puts them back after each test, so the next test draws what the first drew before reseeding."""
    _run_pair(tmp_path, _GENERATOR_TESTS)
