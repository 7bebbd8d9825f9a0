"""Fixtures of the kernel tests: the device to test on, and the Triton interpreter on CPU.

Without a GPU, TRITON_INTERPRET=1 is set at import time (by tests/conftest.py, which every
run loads first; again here, harmlessly), before any test module imports triton (triton reads
it when a kernel is decorated), so the same tests run the Triton kernels on the CPU at small
shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_bf16() -> None:
    """Make the interpreter's bf16 arithmetic what GPUs compute (triton 3.9's is off).

    - float32 -> bfloat16 casts round to nearest even (the interpreter truncates, biasing bf16
      results by up to 2^-8 per rounding);
    - tl.dot on bf16 operands multiplies their values (the interpreter multiplies the raw
      16-bit patterns as integers).
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    convert = interpreter._convert_float
    if getattr(convert, "rounds_like_gpus", False):
        return

    def convert_float(values, src_dtype, dst_dtype, rounding_mode):
        if src_dtype == tl.float32 and dst_dtype == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(values).view(np.float32)).to(
                torch.bfloat16
            )
            return rounded.view(torch.int16).numpy().view(np.uint16)
        return convert(values, src_dtype, dst_dtype, rounding_mode)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = interpreter.TensorHandle(
                convert(a.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32
            )
        if b.dtype.scalar == tl.bfloat16:
            b = interpreter.TensorHandle(
                convert(b.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32
            )
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    convert_float.rounds_like_gpus = True
    interpreter._convert_float = convert_float
    dot = interpreter.InterpreterBuilder.create_dot
    interpreter.InterpreterBuilder.create_dot = create_dot


if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_bf16()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """cuda when available, else cpu (the Triton interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
