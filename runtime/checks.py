"""Cheap checks a command runs before any expensive work (a load, a trace, a compile): is the device
usable by this torch, are a backend's packages installed, is serve's request body limit positive. Each
raises ValueError with one line that names the fix; the CLI prints it and exits 2.
"""
from __future__ import annotations

import importlib.util

import torch

# `serve --max-request-bytes`: a larger body is answered 413 before it is parsed. Here, not in server/, so
# that the CLI's parser shows the default without importing the server's packages (fastapi, pydantic).
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024   # a 256k-token prompt as JSON is ~1-2 MB; 4 MiB leaves room

# the packages each backend imports when it exports or runs a graph, and the extra that installs them
BACKEND_PACKAGES = {"aoti": ((), None), "onnx": (("onnx", "onnx_ir", "onnxscript", "onnxruntime"), "onnx")}


def usable_device(name: str, flag: str = "--device") -> torch.device:
    """`name` as a torch.device this process can run on, else ValueError saying why (a CPU-only torch,
    no GPU visible, not a device name)."""
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{flag} {name!r} is not a device (cpu, cuda, cuda:N, xpu)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = ("this torch is a CPU-only build (install a CUDA build of torch)" if torch.version.cuda is None
               else "no CUDA device is visible")
        raise ValueError(f"{flag} {name}: {why}")
    if dev.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise ValueError(f"{flag} {name}: no XPU device is visible to this torch")
    if dev.type not in ("cpu", "cuda", "xpu"):
        raise ValueError(f"{flag} {name}: onegraph runs on cpu, cuda or xpu")
    return dev


def require_backend(backend: str) -> None:
    """ValueError naming the `pip install` that fixes it when `backend`'s packages are missing."""
    mods, extra = BACKEND_PACKAGES[backend]
    missing = [m for m in mods if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"--backend {backend} needs {', '.join(missing)}: {install_hint(extra)}")


def check_max_request_bytes(n: int) -> int:
    if n < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {n}")
    return n


def install_hint(extra: str) -> str:
    return f"pip install 'onegraph[{extra}]' (from a clone: pip install -e '.[{extra}]')"
