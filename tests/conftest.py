"""Test-session setup. Where Triton is installed but there is no GPU, Triton kernels (the fused loss's)
run under Triton's interpreter on CPU tensors. triton.jit reads TRITON_INTERPRET when triton is first
imported (torch._dynamo imports it), so it is set here, before any test module imports torch's compiler.
Without Triton the environment is left alone."""

import importlib.util
import os

import torch

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
