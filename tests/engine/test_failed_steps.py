"""A step that fails (a device error, an interrupt) before its tokens are read, or after but
before they are taken in, leaves the prefix cache as if it had not been asked for: no
checkpoint that no step computed (a later request would resume from it and answer wrongly),
and no state slot kept from the pool for good (the cache then reuses nothing, then cannot
admit). One that fails while they are taken in keeps the checkpoints published by then whole:
their slots are not handed to another request. A slot copy that fails after them (a decode's
state at a block boundary) leaves no checkpoint of it, in device memory or on disk."""

from __future__ import annotations

import pytest
import torch

from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model
from tests.helpers import cpu_engine, random_prompts

REPLY = SamplingParams(max_tokens=80, ignore_eos=True)
LONG = SamplingParams(max_tokens=30, ignore_eos=True)
SHORT = SamplingParams(max_tokens=20, ignore_eos=True)  # (100 of prompt and it: one block)


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32)


engine, prompts = cpu_engine, random_prompts


def fail_when(eng: LLMEngine, asks) -> None:
    """Make the engine's next launch of a batch that `asks(item, slot)` of a checkpoint target
    fail, its targets left holding zeros (what a slot holds before a step writes it is any
    earlier user's state)."""
    launch = eng.runner.launch

    def failing(batch, after=None, **kw):
        targets = [slot for it in batch.items for _, slot in it.checkpoints if asks(it, slot)]
        if not targets:
            return launch(batch, after, **kw)
        eng.runner.launch = launch
        for pool in eng.runner.caches.conv + eng.runner.caches.ssm:
            pool[targets] = 0
        raise RuntimeError("device error")

    eng.runner.launch = failing


def test_a_recomputed_reply_whose_step_failed_leaves_no_checkpoint(loaded):
    """A reply preempted past 128 is computed again, and the step that was to keep its state at
    128 (the reply-end checkpoint's) fails; the request is aborted, as generate and the server
    abort theirs. The next turn, asked twice, gives the cold tokens: the state at 128 was
    published unwritten, and the second ask resumed from it."""
    cached = engine(loaded, num_kv_blocks=6, checkpoint_interval=0)
    long, prompt = prompts(130, 100)
    first = cached.add_request(long, REPLY)
    cached.step()
    seq = cached.add_request(prompt, REPLY)
    fail_when(cached, lambda it, slot: slot == it.seq.pending_slot)
    with pytest.raises(RuntimeError, match="device error"):
        while cached.has_unfinished():
            cached.step()
    cached.abort(first)
    cached.abort(seq)
    assert seq.num_preemptions > 0 and len(seq) > 128
    turn = prompt + cached.output(seq).token_ids + [5, 6, 7]
    want = engine(loaded, enable_prefix_cache=False).generate([turn], LONG)[0].token_ids
    assert cached.generate([turn], LONG)[0].token_ids == want
    again = cached.generate([turn], LONG)[0]
    assert (again.token_ids, again.num_cached_tokens) == (want, 128)


def test_failed_steps_keep_no_state_slot(loaded):
    """A prefill fails after asking for a checkpoint at 64, with two slots in all (one for a
    request's state, one for a checkpoint): the prompt asked again twice resumes at 64 the
    second time."""
    cached = engine(loaded, num_state_slots=4)
    (prompt,) = prompts(100)
    fail_when(cached, lambda it, slot: True)
    with pytest.raises(RuntimeError, match="device error"):
        cached.generate([prompt], SHORT)
    want = engine(loaded, enable_prefix_cache=False).generate([prompt], SHORT)[0].token_ids
    assert cached.generate([prompt], SHORT)[0].token_ids == want
    again = cached.generate([prompt], SHORT)[0]
    assert (again.token_ids, again.num_cached_tokens) == (want, 64)


def test_a_step_failing_after_its_read_gives_its_checkpoint_slots_back(loaded):
    """The step's tokens are read, then (before the scheduler takes them in) an interrupt: the
    checkpoint slot its prefill asked for at 64 comes back to the pool once the request is
    aborted, as generate aborts it; with two slots in all, the prompt asked again twice still
    resumes at 64 the second time (the leaked slot left none for a checkpoint)."""
    cached = engine(loaded, num_state_slots=4)
    (prompt,) = prompts(100)
    idle = cached.scheduler.slots.num_available
    time_prefill = cached._time_prefill

    def failing(batch, *args, **kwargs):
        if any(it.checkpoints for it in batch.items):
            cached._time_prefill = time_prefill
            raise KeyboardInterrupt
        return time_prefill(batch, *args, **kwargs)

    cached._time_prefill = failing
    with pytest.raises(KeyboardInterrupt):
        cached.generate([prompt], SHORT)
    assert cached._time_prefill is time_prefill  # (it failed where meant to)
    assert not cached.has_unfinished()
    assert cached.scheduler.slots.num_available == idle
    want = engine(loaded, enable_prefix_cache=False).generate([prompt], SHORT)[0].token_ids
    assert cached.generate([prompt], SHORT)[0].token_ids == want
    again = cached.generate([prompt], SHORT)[0]
    assert (again.token_ids, again.num_cached_tokens) == (want, 64)


def fail_after_publishing(eng: LLMEngine) -> None:
    """The scheduler's next publish of a checkpoint succeeds, then raises (once)."""
    publish = eng.scheduler._publish

    def failing(*args, **kwargs):
        publish(*args, **kwargs)
        eng.scheduler._publish = publish
        raise RuntimeError("failed in postprocess")

    eng.scheduler._publish = failing


@pytest.mark.parametrize("num_state_slots, reused", [(4, 0), (6, 64)])
def test_a_checkpoint_published_before_the_failure_is_kept_whole(loaded, num_state_slots, reused):
    """Prompt p fails after its checkpoint at 64 is published; prompt q then runs, and p asked
    again gives the cold tokens (its checkpoint's slot, released too, held q's state by then):
    with two free slots q's checkpoint takes the place of p's, with four p resumes at 64."""
    cached = engine(loaded, num_state_slots=num_state_slots)
    p, q = prompts(100, 100)
    fail_after_publishing(cached)
    with pytest.raises(RuntimeError, match="failed in postprocess"):
        cached.generate([p], SHORT)
    assert not cached.has_unfinished()
    cold = engine(loaded, enable_prefix_cache=False)
    assert cached.generate([q], SHORT)[0].token_ids == cold.generate([q], SHORT)[0].token_ids
    again = cached.generate([p], SHORT)[0]
    assert again.token_ids == cold.generate([p], SHORT)[0].token_ids
    assert again.num_cached_tokens == reused


def fail_copy(eng: LLMEngine) -> None:
    """Make the engine's next slot copy fail (once), its targets left holding zeros."""
    copy_slots = eng.runner.copy_slots

    def failing(copies):
        if not copies:
            return copy_slots(copies)
        eng.runner.copy_slots = copy_slots
        for pool in eng.runner.caches.conv + eng.runner.caches.ssm:
            pool[[dst for _, dst in copies]] = 0
        raise RuntimeError("copy failed")

    eng.runner.copy_slots = failing


@pytest.mark.parametrize("interval", [0, 2])
def test_a_failed_slot_copy_leaves_no_checkpoint(loaded, interval, tmp_path):
    """A reply's decode reaches 128, where its state is to be copied to a checkpoint slot (the
    reply-end checkpoint's pending state; with an interval of two blocks, an interval
    checkpoint), and the copy fails; generate aborts the request. The next turn gives the cold
    tokens and resumes at the prompt's checkpoint (64), not at 128; and so does it from the disk
    tier alone, in an engine opened on the same cache dir afterwards."""
    cached = engine(loaded, checkpoint_interval=interval, cache_dir=tmp_path)
    (prompt,) = prompts(100)
    seq = cached.add_request(prompt, REPLY)
    fail_copy(cached)
    with pytest.raises(RuntimeError, match="copy failed"):
        while cached.has_unfinished():
            cached.step()
    cached.abort(seq)
    assert len(seq) == 129  # (128 computed, the failed step's token taken in)
    turn = prompt + cached.output(seq).token_ids + [5, 6, 7]
    want = engine(loaded, enable_prefix_cache=False).generate([turn], LONG)[0].token_ids
    cached.close()
    fresh = engine(loaded, checkpoint_interval=interval, cache_dir=tmp_path)
    from_disk = fresh.generate([turn], LONG)[0]
    fresh.close()
    assert (from_disk.token_ids, from_disk.num_cached_tokens) == (want, 64)
    again = cached.generate([turn], LONG)[0]
    assert (again.token_ids, again.num_cached_tokens) == (want, 64)
