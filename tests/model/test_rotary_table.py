"""The rotary table only grows: graphs captured over it by one engine keep reading live memory
when another engine over the same model asks for a table of its own; and an engine's steps
read its own table, or none, never the one the model holds for another engine (shorter than
its positions, it failed the step)."""

from __future__ import annotations

import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.layers import RotaryEmbedding
from statechat.model.loader import load_model


def test_a_covering_table_is_kept_and_a_longer_one_extends_it():
    rope = RotaryEmbedding(16, 10_000.0)
    first = rope.build_table(256, torch.float32)
    assert rope.build_table(128, torch.float32) is first
    assert rope.build_table(256, torch.float32) is first
    longer = rope.build_table(512, torch.float32)
    assert longer is not first and longer.shape == (512, 32)
    assert torch.equal(longer[:256], first)  # the first engine's graphs read the same values
    assert rope.table is longer
    cos, sin = rope.cos_sin(torch.tensor([0, 300, 511]), torch.float32, longer)
    ref_cos, ref_sin = rope._compute(torch.tensor([0, 300, 511]), torch.float32)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_another_dtype_builds_a_table_of_its_own():
    rope = RotaryEmbedding(16, 10_000.0)
    first = rope.build_table(256, torch.float32)
    half = rope.build_table(64, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half is not first and len(half) == 64


def test_an_engine_reads_no_table_another_engine_built(tiny_dirs):
    """An engine with no table of its own (the CPU's, an eager one) over a model whose table
    another engine built for its shorter max_model_len gives the tokens it gave before (it
    indexed that table past its end: IndexError here, a device-side assert on a GPU)."""
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", max_model_len=512,
                                    enable_prefix_cache=False), loaded=loaded)
    prompt, params = list(range(3, 203)), SamplingParams(max_tokens=4, ignore_eos=True)
    alone = engine.generate([prompt], params)[0].token_ids
    loaded.model.model.rotary.build_table(128, torch.float32)  # (another engine's capture)
    assert engine.generate([prompt], params)[0].token_ids == alone
