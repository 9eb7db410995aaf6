"""torch.compile in the CPU test runs: the aot_eager backend unless a test is marked `inductor`.

On a machine without CUDA, inductor turns every compiled graph into C++ and builds it with the host
compiler: seconds per graph, minutes over the suite, for a code path no training run takes (training
compiles for a GPU, where inductor emits Triton: `pytest -m gpu` runs those tests with inductor). What
the CPU tests check of compilation (dynamo's graphs and guards, graph breaks under fullgraph=True,
recompiles, functionalized in-place updates, compiled equal to eager) is dynamo's and AOTAutograd's
work, which aot_eager runs in full; only the last step, inductor's code generation, is left out. A test
that checks inductor itself is marked `@pytest.mark.inductor` and compiles with it (conftest.py).

`use_test_backend()` applies it in this process (conftest.py at collection; tests/distributed/parity.py
in each worker); an explicit `backend=` is left as given, and without one inductor's own settings (`mode=`,
`options=`) are dropped with it.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["TEST_BACKEND", "inductor_compile", "use_test_backend", "use_inductor"]

TEST_BACKEND = "aot_eager"
inductor_compile = torch.compile
"""torch.compile as torch defines it (inductor by default)."""


@functools.wraps(inductor_compile)
def _test_compile(model=None, **options):
    if "backend" not in options:  # inductor's own settings (`mode`, `options`) go with it
        options = {key: value for key, value in options.items() if key not in ("mode", "options")}
        options["backend"] = TEST_BACKEND
    return inductor_compile(**options) if model is None else inductor_compile(model, **options)


def use_test_backend() -> None:
    """torch.compile defaults to TEST_BACKEND in this process, where there is no CUDA device."""
    if not torch.cuda.is_available():
        torch.compile = _test_compile


def use_inductor() -> None:
    torch.compile = inductor_compile
