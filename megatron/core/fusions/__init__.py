"""Fused kernels, named by what they fuse: the chunked loss's softmax and gradient, SwiGLU and
the float8 casts (Triton), the cuBLASLt float8 GEMM that adds into fp32 (ctypes), and
`triton_support` (whether Triton runs here). Each has a plain-PyTorch path its callers fall back to."""
