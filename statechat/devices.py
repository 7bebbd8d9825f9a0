"""Backend choice: an Ascend NPU when torch_npu imports and sees one, else CUDA, else the CPU."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from statechat.config import check_device_name
from statechat.errors import ConfigError


def npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' -> npu > cuda > cpu; an explicit name must be available or it is an error."""
    check_device_name(name)
    if name == "auto":
        if npu_available():
            return torch.device("npu")
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for but torch sees no CUDA GPU; use --device "
                          "cpu (device=\"cpu\" from Python) or auto")
    if name == "npu" and not npu_available():
        raise ConfigError("device npu was asked for but torch_npu is missing or sees no NPU; use "
                          "--device cpu (device=\"cpu\" from Python) or auto")
    return torch.device(name)


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on accelerators; float32 on the CPU, where it is exact and not slower."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def accelerator(device: torch.device) -> ModuleType:
    """The torch module of an accelerator's events, memory and graphs: torch.cuda, or torch.npu
    (registered by torch_npu, with the same calls)."""
    if device.type not in ("cuda", "npu"):
        raise ValueError(f"{device} is not an accelerator")
    return torch.npu if device.type == "npu" else torch.cuda


def graph_api(device: torch.device) -> tuple[type, Callable] | None:
    """(graph class, capture context manager) of the device's graphs: torch.cuda's CUDAGraph and
    graph, or torch_npu's NPUGraph and graph (which mirror them); None where there are none (the
    CPU, a torch_npu without graph capture)."""
    if device.type == "cuda":
        return torch.cuda.CUDAGraph, torch.cuda.graph
    npu = getattr(torch, "npu", None) if device.type == "npu" else None
    if npu is not None and hasattr(npu, "NPUGraph") and hasattr(npu, "graph"):
        return npu.NPUGraph, npu.graph
    return None


# (device, stream handle) -> how many live owners capture graphs on that stream
_CAPTURE_STREAMS: dict[tuple[str, int], int] = {}
_STREAM_DRAWS = 64  # draws from torch's stream pool (32 streams a priority) before giving up


def capture_stream(device: torch.device, owner: object) -> Any:
    """A stream of the device's pool that no other live owner captures graphs on, held until
    `owner` is collected. torch (2.11) drops the cuBLAS workspace of a destroyed graph's
    capture stream, which graphs captured on it before still use (pytorch/pytorch#193402), so
    two owners whose graphs come and go apart must not share one. The pool hands its streams
    out in turn; past _STREAM_DRAWS draws (more than 32 live owners) a taken one is shared.
    Streams are told apart by their handles (holding or comparing the stream objects
    themselves crashed torch 2.11 once)."""
    acc = accelerator(device)
    for _ in range(_STREAM_DRAWS):
        stream = acc.Stream(device)
        key = _stream_key(stream, device)
        if key not in _CAPTURE_STREAMS:
            break
    _CAPTURE_STREAMS[key] = _CAPTURE_STREAMS.get(key, 0) + 1
    weakref.finalize(owner, _release_stream, key)
    return stream


def _stream_key(stream: Any, device: torch.device) -> tuple[str, int]:
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:  # (torch_npu's streams)
        handle = getattr(stream, "npu_stream", id(stream))
    return str(getattr(stream, "device", device)), int(handle)


def _release_stream(key: tuple[str, int]) -> None:
    left = _CAPTURE_STREAMS.pop(key, 1) - 1
    if left > 0:
        _CAPTURE_STREAMS[key] = left


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Python's garbage collection paused: a collection during a graph capture may destroy an
    unreachable engine, whose freed memory and graphs invalidate the capture."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def free_memory(device: torch.device) -> int:
    """Free bytes on an accelerator (what the caches may take a share of)."""
    free, _ = accelerator(device).mem_get_info(device)
    return int(free)
