"""The engine runs a tiny Qwen3.5-MoE greedily and its tokens equal transformers' `generate`.

Prompts of mixed lengths join at different steps (continuous batching) with a token budget
small enough to force chunked prefill, on the CPU in float32; the checkpoint names each expert
separately (transformers' save_pretrained default), so loading, routing and the engine's
batching are all exercised together. The same tokens come with so few KV blocks that
sequences are preempted, and from a restarted engine resuming from the disk tier.
"""

from __future__ import annotations

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
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


def test_preempted_sequences_recompute_the_same_tokens(setup):
    path, loaded, prompts, expected = setup
    engine = LLMEngine(
        EngineConfig(model=path, device="cpu", num_kv_blocks=8, max_num_batched_tokens=256),
        loaded=loaded,
    )
    seqs = run_staggered(engine, prompts)
    assert sum(s.num_preemptions for s in seqs) > 0
    assert [s.output_ids for s in seqs] == expected


def test_resumes_from_the_disk_tier_after_a_restart_give_the_cold_tokens(setup, tmp_path):
    """A regenerate, a continue and an edit, answered by a new engine on the first one's cache
    dir, reuse its checkpoints and give the tokens transformers gives each prompt cold."""
    import transformers

    path, loaded, prompts, _ = setup
    config = EngineConfig(model=path, device="cpu", cache_dir=tmp_path, checkpoint_interval=2)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    first = LLMEngine(config, loaded=loaded)
    base = prompts[-1]  # 200 tokens
    reply = first.generate([base], params)[0].token_ids
    first.close()
    again = LLMEngine(config, loaded=load_model(path, dtype=torch.float32))
    again.prefix.cost.prefill_s_per_token = 1.0  # loading always wins: restores are exercised
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # the prompt's and the reply's checkpoints (at 192), an interval one (at 128)
    for ids, reused in [(base, 192), (base + reply, 192), (base[:150] + [7, 8, 9], 128)]:
        got = again.generate([ids], params)[0]
        with torch.no_grad():
            cold = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW,
                               do_sample=False, eos_token_id=None)[0, len(ids):].tolist()
        assert got.num_cached_tokens == reused and got.token_ids == cold
    again.close()
