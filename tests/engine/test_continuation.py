"""The decode step queued before the last one's tokens are read (async scheduling:
Scheduler.can_continue) is not queued after a step whose row resumed a reply from a checkpoint.
A reply preempted where its decode wanted a new block comes back with all but its last token
restored when a checkpoint lies at that boundary (here an identical earlier request's reply-end
one): its one-token chunk is a decode row that reads the checkpoint's slot and writes its own.
The decode graphs feed the step after from their inputs advanced in place, which keep each
row's source slot: queued after it, that row read the checkpoint's state again, one token short
(GraphReplay, DecodeGraphs.run), and the reply went on from a wrong state for good.

Plain Python: a scheduler over its pools and a prefix cache of the device tier alone."""

from __future__ import annotations

from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.prefix import PrefixCache
from statechat.engine.sampling import SamplingParams
from statechat.engine.scheduler import Scheduler
from statechat.engine.sequence import Sequence

BS = 64


def run_step(sched: Scheduler, batch=None) -> None:
    """A step as the engine runs it (each sampled token is 5; a reply ends at max_tokens), of
    `batch` if scheduled already."""
    batch = batch or sched.schedule()
    sched.postprocess(batch, [5] * sum(it.needs_logits for it in batch.items))
    sched.copied()
    for it in batch.items:
        if not it.seq.is_finished and len(it.seq.output_ids) >= it.seq.params.max_tokens:
            sched.finish(it.seq, "length")
    sched.take_new_checkpoints()


def test_no_step_is_queued_after_a_reply_resumed_from_a_checkpoint():
    blocks, slots = BlockPool(16), SlotPool(8)
    prefix = PrefixCache(blocks, slots, None, None, BS, 1, 1, 1e-3)
    sched = Scheduler(blocks, slots, prefix, b"root", BS, max_num_seqs=4,
                      max_num_batched_tokens=256, checkpoint_interval=0)
    prompt = list(range(3, 3 + 2 * BS))  # (its end a block boundary: the reply starts a block)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    sched.add(Sequence(list(prompt), params))  # an earlier request: its reply-end checkpoint
    while sched.has_work():  # lies at the prompt's end
        run_step(sched)
    seq = Sequence(list(prompt), params)
    sched.add(seq)
    run_step(sched)  # its prompt: one token sampled
    assert seq.num_computed == 2 * BS and seq.is_decoding
    sched.preempt(seq)  # (its decode wants a new block, and none is free)
    batch = sched.schedule()
    (it,) = batch.items
    assert seq.num_restored == 2 * BS and it.num_tokens == 1 and it.src_slot != seq.slot
    assert batch.is_decode  # (a decode graph's replay)
    assert not sched.can_continue(batch, 4096)
    run_step(sched, batch)
    batch = sched.schedule()  # the steps after it, from its own slot, are continued
    assert batch.is_decode and sched.can_continue(batch, 4096)
