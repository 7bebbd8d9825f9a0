"""Our Qwen3.5 computes the same numbers as transformers' (float32, CPU, tiny checkpoints).

Covers both checkpoint layouts, prompts of 1/63/64/65/300 tokens, prefill split at several
points with state carried, token-by-token decode, and greedy generation against `generate`.
"""

from __future__ import annotations

import pytest
import torch

from statechat.model.loader import load_model
from tests.helpers import OneSequence

LAYOUTS = ["qwen3_5", "qwen3_5_text"]


def hf_model(path, layout):
    import transformers

    cls = (transformers.Qwen3_5ForConditionalGeneration if layout == "qwen3_5"
           else transformers.Qwen3_5ForCausalLM)
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=LAYOUTS)
def pair(request, tiny_dirs):
    path = tiny_dirs[request.param]
    ours = load_model(path, dtype=torch.float32, device="cpu")
    return ours, hf_model(path, request.param)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    tol = 1e-4 * ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= tol, f"max |diff| {err:.3g} > {tol:.3g}"


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("n", [1, 63, 64, 65, 300])
def test_prefill_logits_match_transformers(pair, n):
    ours, hf = pair
    ids = random_ids(n, ours.config.vocab_size, seed=n)
    logits = OneSequence(ours).step(ids, all_logits=True)
    assert_close(logits, hf_logits(hf, ids))


@pytest.mark.parametrize("splits", [[128, 37], [1, 64, 100], [63, 2, 64, 36]])
def test_split_prefill_equals_full_prefill(pair, splits):
    ours, hf = pair
    ids = random_ids(sum(splits), ours.config.vocab_size, seed=7)
    full = hf_logits(hf, ids)
    seq, parts, start = OneSequence(ours), [], 0
    for n in splits:
        parts.append(seq.step(ids[start : start + n], all_logits=True))
        start += n
    assert_close(torch.cat(parts), full)


def test_token_by_token_decode_equals_prefill(pair):
    ours, hf = pair
    ids = random_ids(80, ours.config.vocab_size, seed=3)
    full = hf_logits(hf, ids)
    seq = OneSequence(ours)
    rows = [seq.step(ids[:10], all_logits=True)] + [seq.step([t]) for t in ids[10:]]
    assert_close(torch.cat(rows), full)


def test_greedy_generation_matches_transformers_generate(pair):
    ours, hf = pair
    tok = ours.tokenizer
    prompts = ["Hello!", "The quick brown fox", "statechat keeps the state", "def main():"]
    for text in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, min_new_tokens=32)
        want = out[0, len(ids):].tolist()
        seq = OneSequence(ours)
        logits = seq.step(ids)
        got = []
        for _ in range(32):
            t = int(logits[-1].argmax())
            got.append(t)
            logits = seq.step([t])
        assert got == want, f"prompt {text!r}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rotary_table_gives_the_computed_cos_and_sin(dtype):
    """The table a graph-capturing runner builds holds exactly what each step would compute;
    a table of another dtype is not used."""
    from statechat.model.layers import RotaryEmbedding

    rotary = RotaryEmbedding(16, 1e7)
    positions = torch.tensor([0, 5, 63, 64, 999, 4095])
    want = rotary.cos_sin(positions, dtype)
    rotary.build_table(4096, dtype)
    got = rotary.cos_sin(positions, dtype)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[0].stride() == got[1].stride()  # one layout, as the rope kernels need
    other = torch.float16
    assert all(torch.equal(a, b)
               for a, b in zip(rotary.cos_sin(positions, other),
                               RotaryEmbedding(16, 1e7).cos_sin(positions, other)))
