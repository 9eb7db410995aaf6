"""Where the project's Triton kernels can run: the one gate the loss, SwiGLU and float8 kernels read.

A kernel runs on CUDA tensors wherever Triton is installed, and on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1, which the tests set). Kernels inside compiled layers (SwiGLU, the float8 casts)
take CPU tensors only where a test allows it (`interpreter_allowed`): a CPU model under torch.compile
would hand them to Inductor's CPU backend, which cannot run them. Kernels called eagerly (the loss's)
use the interpreter whenever it is on.
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

interpreter_allowed = False
"""Set by tests: lets the compiled layers' kernels accept CPU tensors under the interpreter."""


def interpreting() -> bool:
    """Whether Triton runs kernels under its interpreter (read when a kernel is first jitted)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_on(tensor: torch.Tensor, in_compiled_layers: bool) -> bool:
    """Whether a Triton kernel can run on `tensor` here (see the module's docstring)."""
    if not HAS_TRITON:
        return False
    if tensor.is_cuda:
        return True
    allowed = interpreter_allowed or not in_compiled_layers
    return allowed and tensor.device.type == "cpu" and interpreting()


class LazyOp:
    """A `torch.library` op registered on first use: `op = LazyOp(register)`, then `op()(...)`. Registering
    imports Triton and part of Inductor (seconds a process that never runs the kernels would pay), so it
    waits for the first call, or for a model that will use the op (call `op()` before torch.compile traces
    the layer). An object, not a cached function: compiled code traces `op()` into reading the registered
    op, never into the registration."""

    def __init__(self, register):
        self._register, self._op = register, None

    def __call__(self):
        if self._op is None:
            self._op = self._register()
        return self._op
