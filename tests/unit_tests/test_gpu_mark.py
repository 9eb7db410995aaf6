"""The `gpu` mark and its guard (tests/conftest.py), on a scratch suite run by pytest with CUDA hidden: a
marked test (or a marked parameter) skips; a test that skips for lack of CUDA without the mark is an
error, and so is a module that skips whole for it, so `pytest -m gpu tests` cannot miss a CUDA test;
other skips and expected failures stay as they are."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SUITE = '''
import pytest
import torch


@pytest.mark.gpu
def test_marked():
    assert torch.cuda.is_available()  # fails if the mark let it run without CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_unmarked_skipif():
    pass


def test_unmarked_skip_in_the_body():
    pytest.skip("no GPU here")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_parameter(device):
    assert device == "cpu"


@pytest.mark.skip(reason="waits for a data set")
def test_other_skip():
    pass


@pytest.mark.xfail(reason="a known bug", strict=True)
def test_expected_failure():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
'''

MODULE_SKIP = '''
import pytest

pytest.skip("runs on the GPU machine", allow_module_level=True)


def test_hidden():
    pass
'''


def outcomes(report: Path) -> dict:
    """Each test case's outcome in a JUnit XML report (a module's collection keeps the module's name)."""
    result = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("error", "failure", "skipped")]
        name = case.get("name") or case.get("classname")
        result[name] = (kinds[0] if kinds else "passed", "".join(child.get("message", "") for child in case))
    return result


def test_the_guard_turns_unmarked_cuda_skips_into_errors(tmp_path):
    (tmp_path / "pytest.ini").write_text((ROOT / "pytest.ini").read_text())  # the markers, declared once
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
                                          "from tests.conftest import pytest_make_collect_report  # noqa: F401\n"
                                          "from tests.conftest import pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--continue-on-collection-errors",
                          f"--junitxml={tmp_path / 'report.xml'}", str(tmp_path)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=path))
    assert run.returncode == 1, run.stdout + run.stderr
    results = outcomes(tmp_path / "report.xml")
    assert results["test_marked"][0] == "skipped" and "marked gpu" in results["test_marked"][1]
    assert results["test_parameter[cpu]"][0] == "passed" and results["test_parameter[cuda]"][0] == "skipped"
    assert results["test_other_skip"][0] == "skipped"
    assert "1 xfailed" in run.stdout.splitlines()[-1]  # JUnit's report calls an expected failure a skip
    assert results["test_unmarked_skipif"][0] == "error"  # the skip comes in setup
    assert results["test_unmarked_skip_in_the_body"][0] == "failure"
    assert [kind for name, (kind, _) in results.items() if "module_skip" in name] == ["error"]
    assert "test_unmarked_skipif skips for lack of CUDA (Skipped: needs CUDA) but is not marked gpu" in run.stdout
    assert "test_module_skip.py skips whole for lack of CUDA" in run.stdout
    assert "use `pytestmark = pytest.mark.gpu`" in run.stdout
