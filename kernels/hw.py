"""What the launchers need to know about the device: its number of compute cores."""

from __future__ import annotations

import functools

import torch
import triton


@functools.lru_cache(maxsize=8)
def num_cores(device: torch.device) -> int:
    """Streaming multiprocessors (CUDA) or AI cores (Ascend) of the device; a guess elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    except Exception:  # noqa: BLE001 - the interpreter and unknown drivers have no properties
        return 8
    counts = [
        props[k] for k in ("multiprocessor_count", "num_vectorcore", "num_aicore") if k in props
    ]
    return int(counts[0]) if counts else 8
