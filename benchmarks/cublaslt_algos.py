"""cuBLASLt's candidate algorithms for a bf16 ``F.linear`` shape, each callable on its own: the
list ``cublasLtMatmulAlgoGetHeuristic`` returns (best first, as cuBLASLt ranks them), so a probe
can time every one against the kernel cuBLAS picks by itself. ctypes over the libcublasLt that
torch has already loaded (no build step); the layouts are those of ``y = x @ w.T`` with x
``[m, k]``, w ``[n, k]`` and y ``[m, n]`` row-major, i.e. column-major ``y.T = w @ x.T`` with
``w`` transposed ("TN"), float32 accumulation. A probe's helper: the server never calls it.
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch

_CUDA_R_32F, _CUDA_R_16BF = 0, 14
_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE_BYTES = 1
# CUBLASLT_ALGO_CONFIG_*: (attribute, ctypes type) for the configuration each algorithm reports
_CONFIG = {"algo": (0, ctypes.c_int32), "tile": (1, ctypes.c_uint32),
           "splitk": (2, ctypes.c_uint32), "reduction": (3, ctypes.c_uint32),
           "swizzle": (4, ctypes.c_uint32), "stages": (6, ctypes.c_uint32),
           "cluster": (8, ctypes.c_uint16)}  # fmt: skip
WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]  # fmt: skip


def _library() -> ctypes.CDLL:
    """The libcublasLt this process's torch uses (after one bf16 matmul has loaded it)."""
    a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcublasLt.so" in os.path.basename(path):
                return ctypes.CDLL(path)
    site = os.path.dirname(os.path.dirname(torch.__file__))
    found = glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcublasLt.so*"))
    if found:
        return ctypes.CDLL(sorted(found)[-1])
    raise RuntimeError("libcublasLt is not loaded by torch and not found beside it")


class LtLinear:
    """``y = x @ w.T`` in bf16 through cuBLASLt, for one (m, n, k), with any of the candidate
    algorithms the heuristic returns (``len(self.algos)`` of them, at most ``count``)."""

    _lib: ctypes.CDLL | None = None

    def __init__(self, m: int, n: int, k: int, count: int = 32) -> None:
        if LtLinear._lib is None:
            LtLinear._lib = _library()
        self.lib = LtLinear._lib
        self.m, self.n, self.k = m, n, k
        self.handle, self.desc, pref = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        ref = ctypes.byref
        self._lt("cublasLtCreate", ref(self.handle))
        self._lt("cublasLtMatmulDescCreate", ref(self.desc), _COMPUTE_32F, _CUDA_R_32F)
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            self._lt("cublasLtMatmulDescSetAttribute", self.desc, attr, ref(ctypes.c_int32(op)), 4)
        # column-major: A = w as [k, n] (ld k), B = x as [k, m] (ld k), D = y.T as [n, m] (ld n)
        self.layouts = []
        for rows, cols, ld in ((k, n, k), (k, m, k), (n, m, n)):
            layout = ctypes.c_void_p()
            self._lt("cublasLtMatrixLayoutCreate", ref(layout), _CUDA_R_16BF,
                     ctypes.c_uint64(rows), ctypes.c_uint64(cols), ctypes.c_int64(ld))  # fmt: skip
            self.layouts.append(layout)
        self._lt("cublasLtMatmulPreferenceCreate", ref(pref))
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        self._lt("cublasLtMatmulPreferenceSetAttribute", pref, _PREF_MAX_WORKSPACE_BYTES,
                 ref(size), 8)  # fmt: skip
        results, returned = (_Heuristic * count)(), ctypes.c_int(0)
        a, b, d = self.layouts
        self._lt("cublasLtMatmulAlgoGetHeuristic", self.handle, self.desc, a, b, d, d, pref,
                 count, results, ref(returned))  # fmt: skip
        self.lib.cublasLtMatmulPreferenceDestroy(pref)
        self.algos = [results[i] for i in range(returned.value) if results[i].state == 0]
        self.workspace = torch.empty(WORKSPACE_BYTES, device="cuda", dtype=torch.uint8)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _lt(self, fn: str, *args) -> None:
        status = getattr(self.lib, fn)(*args)
        if status != 0:
            raise RuntimeError(f"{fn} failed with cuBLAS status {status}")

    def config(self, i: int) -> dict[str, float]:
        """The i-th algorithm's configuration (algorithm id, tile id, split-K, stages, ...)."""
        out: dict[str, float] = {}
        for name, (attr, ctype) in _CONFIG.items():
            value, written = ctype(0), ctypes.c_size_t(0)
            status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(self.algos[i].algo), attr, ctypes.byref(value), ctypes.sizeof(ctype),
                ctypes.byref(written))  # fmt: skip
            out[name] = int(value.value) if status == 0 else -1
        out["waves"] = round(float(self.algos[i].waves), 2)
        return out

    def __call__(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, i: int) -> None:
        """y = x @ w.T with algorithm i, on torch's current stream (so it can be graph-captured)."""
        assert x.shape == (self.m, self.k) and w.shape == (self.n, self.k)
        assert y.shape == (self.m, self.n) and x.is_contiguous() and w.is_contiguous()
        h, (a, b, d) = self.algos[i], self.layouts
        ptr = ctypes.c_void_p
        self._lt("cublasLtMatmul", self.handle, self.desc, ctypes.byref(self.alpha),
                 ptr(w.data_ptr()), a, ptr(x.data_ptr()), b, ctypes.byref(self.beta),
                 ptr(y.data_ptr()), d, ptr(y.data_ptr()), d, ctypes.byref(h.algo),
                 ptr(self.workspace.data_ptr()), ctypes.c_size_t(h.workspace_size),
                 ptr(torch.cuda.current_stream().cuda_stream))  # fmt: skip
