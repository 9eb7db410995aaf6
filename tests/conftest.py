"""Test-session setup. Where there is no GPU, Triton kernels (the fused loss's) run under Triton's
interpreter on CPU tensors. triton.jit reads TRITON_INTERPRET when triton is first imported (torch._dynamo
imports it), so it is set here, before any test module imports torch's compiler."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
