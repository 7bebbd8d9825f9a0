"""A reply leaves one checkpoint, at the last block boundary before its end (DESIGN.md's
checkpoint policy): also when it was preempted and computed again, and none at a boundary it
crossed before an interval checkpoint. Found by a seeded fuzz of the cache against recompute."""

from __future__ import annotations

import pytest
import torch

from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model
from tests.helpers import cpu_engine, random_prompts

REPLY = SamplingParams(max_tokens=80, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32)


engine, prompts = cpu_engine, random_prompts


def test_a_reply_preempted_past_a_boundary_still_checkpoints_its_end(loaded):
    """A 100-token prompt whose reply crossed 128 is preempted (six KV blocks for two replies)
    and computed again: the next turn resumes at 128, the reply's end, not at the prompt's 64."""
    cached = engine(loaded, num_kv_blocks=6, checkpoint_interval=0)
    long, prompt = prompts(130, 100)
    first = cached.add_request(long, REPLY)
    cached.step()
    seq = cached.add_request(prompt, REPLY)
    while cached.has_unfinished():
        cached.step()
    assert seq.num_preemptions > 0 and first.num_preemptions == 0
    turn = prompt + cached.output(seq).token_ids + [5, 6, 7]
    got = cached.generate([turn], SHORT)[0]
    want = engine(loaded, enable_prefix_cache=False).generate([turn], SHORT)[0]
    assert got.num_cached_tokens == 128
    assert got.token_ids == want.token_ids


def test_a_reply_keeps_no_checkpoint_before_an_interval_one_it_crossed(loaded):
    """A reply from 120 to 199 tokens crosses 128, then 192 (the interval's, every 3 blocks):
    its end is checkpointed at 192, and 128 holds none, so a fork at 150 resumes at 64."""
    cached = engine(loaded, checkpoint_interval=3)
    (prompt,) = prompts(120)
    reply = cached.generate([prompt], REPLY)[0].token_ids
    fork = (prompt + reply)[:150] + [5, 6]
    assert cached.generate([fork], SHORT)[0].num_cached_tokens == 64
    turn = prompt + reply + [5, 6]
    assert cached.generate([turn], SHORT)[0].num_cached_tokens == 192


def test_a_prompt_that_ends_on_a_boundary_keeps_it_for_an_edited_reply(loaded):
    """A 128-token prompt (two whole blocks) whose reply runs past 192: an edit of the reply
    resumes at the prompt's end, 128 (DESIGN.md: an edited reply costs at most 63 prompt
    tokens), and a regenerate at 64, since it must compute the prompt's last token again."""
    cached = engine(loaded, checkpoint_interval=0)
    (prompt,) = prompts(128)
    reply = cached.generate([prompt], REPLY)[0].token_ids
    fork = (prompt + reply)[:150] + [5, 6]
    got = cached.generate([fork], SHORT)[0]
    want = engine(loaded, enable_prefix_cache=False).generate([fork], SHORT)[0]
    assert got.num_cached_tokens == 128
    assert got.token_ids == want.token_ids
    assert cached.generate([prompt], SHORT)[0].num_cached_tokens == 64
