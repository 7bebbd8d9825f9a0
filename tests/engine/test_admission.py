"""A request that waits for KV blocks (others' replies hold them) restores its cached prefix once,
not at every step: an admission that gave way at once for want of blocks is tried again only
when as many blocks are spare as it took, or once the prefix it restored has left the device
(then a block for its chunk is enough). Once blocks are freed it resumes from its prefix all the
same. A request aborted before a step of it ran (while it waits, or admitted beside a prompt
that takes the whole budget) reports what one never admitted reports: no reuse, no plan and
nothing computed.

Plain Python (a scheduler over its pools and a prefix cache of the device tier alone), then the
engine with a host tier, whose restore reads the host's blocks and checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.output import request_output
from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.prefix import PrefixCache
from statechat.engine.sampling import SamplingParams
from statechat.engine.scheduler import Scheduler
from statechat.engine.sequence import Sequence
from statechat.model.loader import load_model

BS = 64


def count_reuses(prefix: PrefixCache, monkeypatch) -> dict[int, int]:
    """Restores planned per sequence (PrefixCache.reuse calls), by seq_id."""
    calls: dict[int, int] = {}
    reuse = prefix.reuse

    def counted(seq: Sequence) -> int:
        calls[seq.seq_id] = calls.get(seq.seq_id, 0) + 1
        return reuse(seq)

    monkeypatch.setattr(prefix, "reuse", counted)
    return calls


def run_step(sched: Scheduler) -> None:
    """A step as the engine runs it: each sampled token is 5; a reply ends at max_tokens."""
    batch = sched.schedule()
    assert batch.items
    sched.postprocess(batch, [5] * sum(it.needs_logits for it in batch.items))
    sched.copied()
    for it in batch.items:
        seq = it.seq
        if not seq.is_finished and len(seq.output_ids) >= seq.params.max_tokens:
            sched.finish(seq, "length")
    sched.take_new_checkpoints()


def request(tokens: list[int], max_tokens: int) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def setup(budget: int, monkeypatch) -> tuple[Scheduler, dict[int, int], list[int]]:
    """A scheduler of 8 blocks whose device tier holds the checkpoint at 192 of a 200-token
    prompt (its 3 blocks cached, unused), and its count of restores."""
    blocks, slots = BlockPool(8), SlotPool(8)
    prefix = PrefixCache(blocks, slots, None, None, BS, 1, 1, 1e-3)
    sched = Scheduler(blocks, slots, prefix, b"root", BS, max_num_seqs=4,
                      max_num_batched_tokens=budget, checkpoint_interval=0)
    first = list(range(200))
    sched.add(request(first, 1))
    while sched.has_work():
        run_step(sched)
    return sched, count_reuses(prefix, monkeypatch), first


def test_a_waiting_request_restores_its_prefix_once_while_blocks_are_short(monkeypatch):
    sched, calls, first = setup(256, monkeypatch)
    long = request([7] * 290, 20)  # 5 blocks for its whole reply: 3 are left
    sched.add(long)
    run_step(sched)
    waits = request(first + [6], 3)  # 3 blocks restored and 1 for its last 9 tokens
    sched.add(waits)
    while not long.is_finished:
        run_step(sched)
        if not long.is_finished:
            assert waits in sched.waiting
            assert (waits.num_cached_tokens, waits.cache_plan) == (-1, None)
    assert calls[waits.seq_id] == 1 and waits.num_preemptions == 1
    while sched.has_work():
        run_step(sched)
    assert calls[waits.seq_id] == 2
    assert waits.num_cached_tokens == 192 and len(waits.output_ids) == 3


def test_one_whose_prefix_is_evicted_meanwhile_waits_for_no_more_than_its_chunk(monkeypatch):
    """The reply that holds the blocks takes a 6th at 320 tokens, evicting the waiting one's
    prefix: that one is then admitted with the block left, and computes its prompt."""
    sched, calls, first = setup(65, monkeypatch)
    long = request([7] * 290, 60)
    sched.add(long)
    for _ in range(5):
        run_step(sched)
    waits = request(first + [6], 3)
    sched.add(waits)
    run_step(sched)
    assert waits in sched.waiting and calls[waits.seq_id] == 1  # (it took 3 blocks, needed 4)
    while waits in sched.waiting:
        assert not long.is_finished
        run_step(sched)
    assert len(long) > 320 and not long.is_finished
    while sched.has_work():
        run_step(sched)
    assert (waits.num_cached_tokens, len(waits.output_ids)) == (0, 3)


def test_one_aborted_before_its_restore_served_a_chunk_reports_no_reuse(monkeypatch):
    """Admitted beside an older prompt that takes the whole budget, a request holds its restored
    prefix but computes nothing; aborted then, it reports no reuse and nothing computed."""
    sched, _, first = setup(64, monkeypatch)
    older = request([7] * 400, 1)
    sched.add(older)
    run_step(sched)
    waits = request(first + [6], 3)
    sched.add(waits)
    for _ in range(3):
        run_step(sched)
    assert waits in sched.running and waits.num_restored == 192  # (no chunk yet)
    sched.finish(waits, "abort")
    out = request_output(waits)
    assert (out.num_cached_tokens, out.num_computed_tokens, out.cache_plan) == (0, 0, None)
    while sched.has_work():
        run_step(sched)
    assert sched.blocks.num_available == 8


def test_a_request_aborted_while_it_waits_for_blocks_reports_no_reuse(tiny_dirs, tmp_path,
                                                                      monkeypatch):
    path = tiny_dirs["qwen3_5_text"]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", num_kv_blocks=8, cache_dir=tmp_path),
                       loaded=load_model(path, dtype=torch.float32))
    gen = torch.Generator().manual_seed(11)
    x, y = (torch.randint(0, 300, (n,), generator=gen).tolist() for n in (200, 290))
    engine.generate([x], SamplingParams(max_tokens=1))
    engine.drop_device_cache()  # (its checkpoint at 192 is in the host tier alone)
    calls = count_reuses(engine.prefix, monkeypatch)
    long = engine.add_request(y, SamplingParams(max_tokens=60, ignore_eos=True))
    while not long.is_decoding:
        engine.step()
    waits = engine.add_request(x + [5], SamplingParams(max_tokens=3, ignore_eos=True))
    behind = engine.add_request(x + [6], SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(10):
        engine.step()
    assert waits.num_preemptions > 0 and calls[waits.seq_id] == 1
    engine.abort(waits)
    engine.abort(behind)
    engine.close()
    never_admitted = engine.output(behind)
    assert behind.seq_id not in calls
    out = engine.output(waits)
    for got in (out, never_admitted):
        assert (got.finish_reason, got.num_cached_tokens, got.num_computed_tokens) == (
            "abort", 0, 0)
        assert (got.cache_plan, got.reused_from, got.reused_by_tier) == (None, None, None)


def test_an_admission_whose_restore_raises_leaves_nothing_reported(monkeypatch):
    """A restore that fails (a device error while loading: the step raises) leaves the request
    waiting as it was: no reuse, no plan, and no entry kept for it in `reported` (which holds
    running sequences alone) nor its working slot held, so that aborting it then leaks
    nothing."""
    sched, _, first = setup(256, monkeypatch)

    def failing(seq: Sequence) -> int:
        seq.cache_plan = {"choice": "load"}  # (planned, then its load failed)
        raise RuntimeError("device error")

    monkeypatch.setattr(sched.prefix, "reuse", failing)
    waits = request(first + [6], 3)
    sched.add(waits)
    free_slots = sched.slots.num_available
    with pytest.raises(RuntimeError):
        sched.schedule()
    assert waits in sched.waiting and sched.reported == {}
    assert (waits.slot, sched.slots.num_available) == (0, free_slots)
    assert (waits.num_cached_tokens, waits.cache_plan, waits.reused_from) == (-1, None, None)
