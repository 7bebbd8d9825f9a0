"""Host-memory copies for the cache's own threads, made by numpy on the calling thread alone.

A torch CPU op large enough to split (a copy, rows picked by index, `contiguous`) starts an
OpenMP thread team for the thread that runs it, and the team lives as long as that thread.
With more OpenMP threads than cores, libgomp has every team, the engine's too, sleep at its
barriers rather than spin: beside the writer thread's team a CPU engine's decode ran 2.7 times
slower (docs/bench.md). `torch.set_num_threads` cannot help there: it is one setting for the
whole process (threads that start after it use it too). So the writer moves host bytes with
numpy, which copies on the calling thread and releases the GIL meanwhile as torch does.

    copy_into(dst, src)      # dst[...] = src, both host tensors of one shape and dtype
    take_rows(t, rows)       # t[rows], a new contiguous host tensor
    contiguous(t)            # t itself, or a contiguous copy of it
"""

from __future__ import annotations

import numpy as np
import torch

# numpy has no bfloat16: elements move as integers of their width (a copy changes no bit)
_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of host tensor `t`'s elements (its shape and strides), as integers."""
    return t.detach().view(_SAME_WIDTH[t.element_size()]).numpy()


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(a).view(dtype)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy host tensor `src` into host tensor `dst` (same shape and dtype, any strides) on
    this thread; returns `dst`."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy of {src.dtype} {list(src.shape)} into "
                         f"{dst.dtype} {list(dst.shape)}")
    np.copyto(_array(dst), _array(src), casting="no")
    return dst


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows `rows` of host tensor `t` (its first dimension), as a new contiguous tensor."""
    return _tensor(np.ascontiguousarray(_array(t)[rows]), t.dtype)


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """Host tensor `t` if it is contiguous, else a contiguous copy made on this thread."""
    if t.is_contiguous():
        return t
    return _tensor(np.ascontiguousarray(_array(t)), t.dtype)
