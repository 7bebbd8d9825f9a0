"""The engine runs a tiny Qwen3.5-MoE greedily and its tokens equal transformers' `generate`.

Prompts of mixed lengths join at different steps (continuous batching) with a token budget
small enough to force chunked prefill, on the CPU in float32; the checkpoint names each expert
separately (transformers' save_pretrained default), so loading, routing and the engine's
batching are all exercised together.
"""

from __future__ import annotations

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.model.loader import load_model
from tests.engine.test_engine_parity import NEW, run_staggered
from tests.helpers import make_tiny

LENGTHS = [5, 64, 65, 150, 200]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import transformers

    path = make_tiny(
        tmp_path_factory.mktemp("moe") / "text",
        layout="qwen3_5_text",
        dtype="float32",
        moe=True,
        per_expert=True,
        seed=3,
    )
    loaded = load_model(path, dtype=torch.float32)
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(12)
    prompts = [
        torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS
    ]
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]),
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                eos_token_id=None,
            )  # ignore_eos: no EOS suppression either
        expected.append(out[0, len(p) :].tolist())
    return path, loaded, prompts, expected


def test_engine_greedy_matches_transformers(setup):
    path, loaded, prompts, expected = setup
    engine = LLMEngine(
        EngineConfig(model=path, device="cpu", max_num_batched_tokens=128), loaded=loaded
    )
    seqs = run_staggered(engine, prompts)
    for i, (seq, e) in enumerate(zip(seqs, expected)):
        assert seq.output_ids == e, f"prompt {i} ({LENGTHS[i]} tokens)"
