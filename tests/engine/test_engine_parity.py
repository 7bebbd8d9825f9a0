"""The engine's greedy tokens equal transformers' greedy `generate` for each prompt alone.

Eight prompts of mixed lengths join at different steps (continuous batching), on the CPU in
float32; the same holds with a token budget small enough to force chunked prefill and with so
few KV blocks that sequences are preempted and recomputed.
"""

from __future__ import annotations

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model

LENGTHS = [5, 40, 64, 65, 100, 150, 200, 300]
NEW = 24


def prompts_and_expected(path, vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The eight prompts and transformers' greedy continuation of each alone (CPU, float32)."""
    import transformers

    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        expected.append(out[0, len(p):].tolist())
    return prompts, expected


@pytest.fixture(scope="module")
def setup(tiny_dirs):
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    return path, loaded, *prompts_and_expected(path, loaded.config.vocab_size)


def run_staggered(engine: LLMEngine, prompts: list[list[int]]) -> list:
    """Submit two prompts, then more every few steps, until all finish."""
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    pending, seqs, step = list(prompts), [], 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            for _ in range(2 if step == 0 else 3):
                if pending:
                    seqs.append(engine.add_request(pending.pop(0), params))
        engine.step()
        step += 1
    return seqs


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"max_num_batched_tokens": 64},
        {"num_kv_blocks": 10, "max_num_batched_tokens": 256},
    ],
    ids=["plain", "chunked", "preempted"],
)
def test_staggered_batch_matches_transformers(setup, overrides):
    path, loaded, prompts, expected = setup
    engine = LLMEngine(EngineConfig(model=path, device="cpu", **overrides), loaded=loaded)
    seqs = run_staggered(engine, prompts)
    for i, (seq, e) in enumerate(zip(seqs, expected)):
        assert seq.output_ids == e, f"prompt {i} ({LENGTHS[i]} tokens)"
    if "num_kv_blocks" in overrides:
        assert sum(s.num_preemptions for s in seqs) > 0


def test_fast_decode_gives_the_tokenizers_text(setup):
    """The engine's detokenizer (the Rust backend, bypassing transformers' wrapper) returns
    exactly what the tokenizer's own decode does, special tokens and broken UTF-8 included."""
    from statechat.engine.engine import _fast_decode

    tokenizer = setup[1].tokenizer
    decode = _fast_decode(tokenizer)
    g = torch.Generator().manual_seed(0)
    for n in [0, 1, 2, 3, 5, 8] * 50:
        ids = torch.randint(0, len(tokenizer), (n,), generator=g).tolist()
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
