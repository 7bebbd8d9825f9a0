"""The rotary table only grows: graphs captured over it by one engine keep reading live memory
when another engine over the same model asks for a table of its own."""

from __future__ import annotations

import torch

from statechat.model.layers import RotaryEmbedding


def test_a_covering_table_is_kept_and_a_longer_one_extends_it():
    rope = RotaryEmbedding(16, 10_000.0)
    first = rope.build_table(256, torch.float32)
    assert rope.build_table(128, torch.float32) is first
    assert rope.build_table(256, torch.float32) is first
    longer = rope.build_table(512, torch.float32)
    assert longer is not first and longer.shape == (512, 32)
    assert torch.equal(longer[:256], first)  # the first engine's graphs read the same values
    assert rope.table is longer
    cos, sin = rope.cos_sin(torch.tensor([0, 300, 511]), torch.float32)
    ref_cos, ref_sin = rope._compute(torch.tensor([0, 300, 511]), torch.float32)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_another_dtype_builds_a_table_of_its_own():
    rope = RotaryEmbedding(16, 10_000.0)
    first = rope.build_table(256, torch.float32)
    half = rope.build_table(64, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half is not first and len(half) == 64
