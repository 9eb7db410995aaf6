"""Folders say what they hold: kernels in megatron/core/fusions/, float8 in megatron/core/fp8/.

A hand-written kernel (a Triton program, a ctypes binding) or a float8 GEMM or cast anywhere else in the
library is a lever in the wrong place: a newcomer asking "where is fp8?" or "which kernels do we ship?"
must find one folder. The markers below are what such code cannot do without."""

import pathlib
import re

import megatron

LIBRARY = pathlib.Path(megatron.__file__).parent
KERNEL = re.compile(r"^\s*(import triton|from triton|import ctypes)|@triton\.jit", re.M)
FLOAT8 = re.compile(r"torch\._scaled_mm|torch\.float8_e4m3fn|torch\.float8_e5m2")


def library_files():
    return sorted(path for path in LIBRARY.rglob("*.py") if "__pycache__" not in path.parts)


def offenders(pattern, home):
    return [str(path.relative_to(LIBRARY)) for path in library_files()
            if pattern.search(path.read_text()) and home not in path.relative_to(LIBRARY).parts]


def test_kernels_live_in_fusions():
    assert offenders(KERNEL, "fusions") == []


def test_float8_lives_in_fp8_and_its_kernels_in_fusions():
    outside = [path for path in offenders(FLOAT8, "fp8") if not path.startswith("core/fusions/")]
    assert outside == []


def test_tensor_parallel_holds_no_kernel_or_float8_file():
    names = [path.name for path in (LIBRARY / "core" / "tensor_parallel").glob("*.py")]
    assert [name for name in names if re.search(r"triton|float8|fp8|cublas|fused", name)] == []


def test_the_markers_find_what_they_look_for():
    """The checks above cannot pass for want of a match: the kernels and float8 code exist where they belong."""
    fusions = [path for path in library_files() if "fusions" in path.parts]
    fp8 = [path for path in library_files() if "fp8" in path.parts]
    assert sum(bool(KERNEL.search(path.read_text())) for path in fusions) >= 5
    assert any(FLOAT8.search(path.read_text()) for path in fp8)
