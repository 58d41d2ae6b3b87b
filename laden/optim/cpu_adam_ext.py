"""Lazy build and ctypes binding of the host AdamW kernels in `csrc/cpu_adam.cpp`.

The kernels are built once per (source, torch version, CPU, compiler flags) with
`torch.utils.cpp_extension.load` into `$XDG_CACHE_HOME/laden/torch_extensions/<key>` (default
`~/.cache/...`), and bound with ctypes instead of pybind11. The trade-off: the C++ file
includes no PyTorch header, so a cold build takes seconds rather than most of a minute on a
small machine, and ctypes releases the GIL for the whole kernel, so the update can run on an
engine thread next to the GPU driver thread. The cost is ~1-2 us of call overhead per tensor
and that the Python side checks dtypes, devices and contiguity itself (see `cpu_adam.py`).

`-march=native` ties the binary to the CPU, so the CPU flags are part of the cache key: a
home directory shared between different hosts gets one build per CPU model.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from pathlib import Path

import torch

_SOURCE = Path(__file__).parent / "csrc" / "cpu_adam.cpp"
# -fno-math-errno: without it sqrtf may set errno, a branch that blocks loop vectorization.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_error: str | None = None
_attempted = False

_D = ctypes.c_double
_P = ctypes.c_void_p
_SCALAR_ARGTYPES: list[type] = [_D, _D, _D, _D, _D, _D, _D, ctypes.c_int]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def build_dir() -> Path:
    """The build directory for the current source, torch version and CPU."""
    key = hashlib.sha256()
    key.update(_SOURCE.read_bytes())
    key.update(torch.__version__.encode())
    key.update(_cpu_flags().encode())
    key.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache_root / "laden" / "torch_extensions" / f"cpu_adam_{key.hexdigest()[:16]}"


def _build() -> ctypes.CDLL:
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = cpp_extension.load(
        name=f"laden_cpu_adam_{directory.name[-16:]}",
        sources=[str(_SOURCE)],
        extra_cflags=_CFLAGS,
        extra_ldflags=_LDFLAGS,
        build_directory=str(directory),
        with_cuda=False,
        is_python_module=False,
        verbose=False,
    )
    library = ctypes.CDLL(str(path))
    fp32 = library.laden_adamw_fp32
    fp32.argtypes = [_P, _P, ctypes.c_int, _P, _P, _P, ctypes.c_int64, *_SCALAR_ARGTYPES]
    fp32.restype = ctypes.c_int
    kahan = library.laden_adamw_bf16_kahan
    kahan.argtypes = [_P, _P, _P, ctypes.c_int, _P, _P, ctypes.c_int64, *_SCALAR_ARGTYPES]
    kahan.restype = ctypes.c_int
    return library


def load_library() -> tuple[ctypes.CDLL | None, str | None]:
    """Build (first call only) and return `(library, None)`, or `(None, reason)` on failure."""
    global _library, _error, _attempted
    with _lock:
        if not _attempted:
            _attempted = True
            try:
                _library = _build()
            except Exception as exc:  # a missing compiler/ninja or a compile error: fall back
                _error = (
                    f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
                )
        return _library, _error
