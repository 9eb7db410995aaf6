"""cuBLASLt's tensorwise-scaled float8 GEMM with beta = 1, called through ctypes: `scaled_mm_add_`
adds a float8 product into an fp32 tensor inside the GEMM.

`torch._scaled_mm` runs the same cuBLASLt GEMM with beta = 0 and exposes no beta, so a float8 layer's
weight gradient for a micro-batch after a step's first left its GEMM as a fresh fp32 tensor that autograd
then added to `.grad` in a pass of its own: 16 bytes a parameter moved where the GEMM's epilogue needs 8
(about 20 ms a `7b-shape` step of 4 micro-batches on an H100; a Triton float8 GEMM that added in its
epilogue ran at two thirds of cuBLAS's rate, docs/performance_history.md). Here the GEMM reads `.grad` as its C
and writes the sum to it as its D.

The library is the libcublasLt that torch's CUDA build already loaded (found in the process's memory
map), so nothing is compiled or installed. Per device: one handle and a 32 MiB workspace; per problem
(shape and dtypes): its descriptors and the heuristic's first algorithm, made once. Only the two scale
pointers change between calls. Operands as `torch._scaled_mm` wants them: out [M, N] fp32, a [M, K] and
b_t [N, K] row-major float8 (out += scale_a * scale_b * a @ b_t^T), every dimension a multiple of 16,
fp32 accumulation with cuBLAS's periodic promotion (no fast accumulation, as the weight gradient's
`_scaled_mm`). The first call of each problem also runs it on a copy and checks the sum against
`_scaled_mm`'s product added (one host synchronisation). Where cuBLASLt cannot run it (CPU, an older GPU,
a ROCm build, a status other than success at set-up, a sum that fails that check) the op adds
`_scaled_mm`'s fp32 product instead, the sum autograd made, and says so once.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Dict, Optional, Tuple

import torch

# cublasLt.h / library_types.h
_COMPUTE_32F = 68                     # cublasComputeType_t CUBLAS_COMPUTE_32F
_R_32F = 0                            # cudaDataType_t CUDA_R_32F
_FLOAT8 = {torch.float8_e4m3fn: 28, torch.float8_e5m2: 29}  # CUDA_R_8F_E4M3, CUDA_R_8F_E5M2
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4     # cublasLtMatmulDescAttributes_t
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_PREF_MAX_WORKSPACE_BYTES = 1         # cublasLtMatmulPreferenceAttributes_t
WORKSPACE_BYTES = 32 << 20


class _HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _loaded_library_path() -> Optional[str]:
    """The path of the libcublasLt this process has mapped (torch's CUDA build loads it), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if "libcublasLt.so" in path:
                    return path
    except OSError:
        return None
    return None


class _Lt:
    """The library, its handles and workspaces (per device) and the problems set up so far."""

    def __init__(self, library: ctypes.CDLL):
        self.lib = library
        self.handles: Dict[int, ctypes.c_void_p] = {}
        self.workspaces: Dict[int, torch.Tensor] = {}
        self.problems: Dict[tuple, tuple] = {}

    def call(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise RuntimeError(f"cuBLASLt {name} returned status {status}")

    def handle(self, device: int) -> ctypes.c_void_p:
        if device not in self.handles:
            handle = ctypes.c_void_p()
            self.call("cublasLtCreate", ctypes.byref(handle))
            self.handles[device] = handle
            self.workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")
        return self.handles[device]

    def _layout(self, dtype: int, rows: int, columns: int, leading: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self.call("cublasLtMatrixLayoutCreate", ctypes.byref(layout), ctypes.c_int(dtype), ctypes.c_uint64(rows),
                  ctypes.c_uint64(columns), ctypes.c_int64(leading))
        return layout

    def _set(self, setter: str, target: ctypes.c_void_p, attribute: int, value) -> None:
        self.call(setter, target, ctypes.c_int(attribute), ctypes.byref(value), ctypes.c_size_t(ctypes.sizeof(value)))

    def problem(self, device: int, m: int, n: int, k: int, a_dtype: torch.dtype, b_dtype: torch.dtype) -> tuple:
        """(matmul descriptor, layouts A, B, C=D, algorithm) of out[M, N] += a[M, K] @ b_t[N, K]^T. cuBLAS is
        column-major: out^T [N, M] = (b_t viewed [K, N], transposed) x (a viewed [K, M]), its "TN" float8 form."""
        key = (device, m, n, k, a_dtype, b_dtype)
        if key not in self.problems:
            desc = ctypes.c_void_p()
            self.call("cublasLtMatmulDescCreate", ctypes.byref(desc), ctypes.c_int(_COMPUTE_32F), ctypes.c_int(_R_32F))
            self._set("cublasLtMatmulDescSetAttribute", desc, _DESC_TRANSA, ctypes.c_int(_OP_T))
            self._set("cublasLtMatmulDescSetAttribute", desc, _DESC_TRANSB, ctypes.c_int(_OP_N))
            first = self._layout(_FLOAT8[b_dtype], k, n, k)
            second = self._layout(_FLOAT8[a_dtype], k, m, k)
            out = self._layout(_R_32F, n, m, n)
            preference = ctypes.c_void_p()
            self.call("cublasLtMatmulPreferenceCreate", ctypes.byref(preference))
            self._set("cublasLtMatmulPreferenceSetAttribute", preference, _PREF_MAX_WORKSPACE_BYTES,
                      ctypes.c_uint64(WORKSPACE_BYTES))
            result, found = _HeuristicResult(), ctypes.c_int(0)
            self.call("cublasLtMatmulAlgoGetHeuristic", self.handle(device), desc, first, second, out, out,
                      preference, ctypes.c_int(1), ctypes.byref(result), ctypes.byref(found))
            self.call("cublasLtMatmulPreferenceDestroy", preference)
            if found.value == 0:
                raise RuntimeError(f"cuBLASLt has no algorithm for a float8 GEMM of {m}x{n}x{k}")
            self.problems[key] = (desc, first, second, out, result)
        return self.problems[key]

    def scaled_mm_add_(self, out, a, b_t, scale_a, scale_b) -> None:
        device = out.device.index if out.device.index is not None else torch.cuda.current_device()
        (m, k), n = a.shape, b_t.shape[0]
        desc, first, second, layout, result = self.problem(device, m, n, k, a.dtype, b_t.dtype)
        self._set("cublasLtMatmulDescSetAttribute", desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(scale_b.data_ptr()))
        self._set("cublasLtMatmulDescSetAttribute", desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(scale_a.data_ptr()))
        one, workspace = ctypes.c_float(1.0), self.workspaces[device]
        self.call("cublasLtMatmul", self.handle(device), desc, ctypes.byref(one), ctypes.c_void_p(b_t.data_ptr()),
                  first, ctypes.c_void_p(a.data_ptr()), second, ctypes.byref(one), ctypes.c_void_p(out.data_ptr()),
                  layout, ctypes.c_void_p(out.data_ptr()), layout, ctypes.byref(result.algo),
                  ctypes.c_void_p(workspace.data_ptr()), ctypes.c_size_t(WORKSPACE_BYTES),
                  ctypes.c_void_p(torch.cuda.current_stream(out.device).cuda_stream))


_lt: Optional[_Lt] = None
_unavailable: Dict[Tuple, str] = {}
"""Why cuBLASLt did not run a problem (its key: device and dtypes); those fall back to `_scaled_mm` and an add."""
_verified: set = set()
"""The problems (device, dtypes, shapes) whose cuBLASLt sum agreed with `_scaled_mm`'s on their first call."""


_searched = False


def _library() -> Optional[_Lt]:
    """The binding, made on first use (None where torch's CUDA build and its libcublasLt are not here)."""
    global _lt, _searched
    if not _searched and torch.version.cuda is not None and torch.cuda.is_available():
        _searched = True
        torch.cuda.init()
        path = _loaded_library_path()
        if path is not None:
            _lt = _Lt(ctypes.CDLL(path))
    return _lt


def available(device: torch.device) -> bool:
    """Whether `scaled_mm_add_` adds inside cuBLASLt's GEMM on `device` (a CUDA GPU with float8 GEMMs,
    compute capability 8.9 or newer, and torch's libcublasLt loaded)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    return _library() is not None


def _checked(out, a, b_t) -> bool:
    """Whether the operands are the op's: fp32 out [M, N], float8 a [M, K] and b_t [N, K], contiguous, every
    dimension a multiple of 16 (cuBLASLt's float8 alignment)."""
    return (out.dtype == torch.float32 and a.dtype in _FLOAT8 and b_t.dtype in _FLOAT8
            and all(t.is_contiguous() for t in (out, a, b_t)) and out.shape == (a.shape[0], b_t.shape[0])
            and a.shape[1] == b_t.shape[1] and all(size % 16 == 0 for size in (*a.shape, b_t.shape[0])))


@torch.library.custom_op("megadlms::scaled_mm_add_", mutates_args=("out",))
def scaled_mm_add_(out: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, scale_a: torch.Tensor,
                   scale_b: torch.Tensor) -> None:
    """out += scale_a * scale_b * (a @ b_t^T) in place (see the module): inside cuBLASLt's GEMM where it
    runs, else `_scaled_mm`'s fp32 product added. An op of its own, so a compiled backward adds into the
    gradient itself."""
    key = (out.device, a.dtype, b_t.dtype)
    if key not in _unavailable and _checked(out, a, b_t) and available(out.device):
        try:
            problem = (*key, a.shape, b_t.shape)
            if problem not in _verified:
                if not _agrees(out, a, b_t, scale_a, scale_b):
                    raise RuntimeError("its sum differs from _scaled_mm's product added")
                _verified.add(problem)
            _library().scaled_mm_add_(out, a, b_t, scale_a, scale_b)
            return
        except RuntimeError as error:  # at set-up (no algorithm, a status, a wrong sum): `out` untouched
            _unavailable[key] = str(error)
            warnings.warn(f"cuBLASLt's float8 GEMM with beta = 1 does not run here ({error}); the float8 weight "
                          "gradients are added by a pass of their own")
    out.add_(_product(a, b_t, scale_a, scale_b))


def _product(a, b_t, scale_a, scale_b) -> torch.Tensor:
    return torch._scaled_mm(a, b_t.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)


def _agrees(out, a, b_t, scale_a, scale_b) -> bool:
    """Whether cuBLASLt's sum on a copy of `out` is `_scaled_mm`'s product added, within fp32 rounding: run
    once per problem, before its first real call, so a binding that disagrees with the library (another
    enum value, another layout convention) falls back instead of training on wrong gradients."""
    expected, trial = out + _product(a, b_t, scale_a, scale_b), out.clone()
    _library().scaled_mm_add_(trial, a, b_t, scale_a, scale_b)
    tolerance = 1e-4 * (expected - out).abs().max() + 1e-30
    return bool(((trial - expected).abs() <= tolerance + 1e-5 * expected.abs()).all())
