"""LLMEngine: the glue between tokenizer, scheduler, pools and model runner.

    engine = LLMEngine(EngineConfig(model=path))
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32))
    for event in engine.stream(prompt_ids, params): ...

(The request API, generate and stream among it, is requests.py's; n samples, samples.py's;
its construction, setup.py's.)

Every finished request reports its prompt tokens, tokens reused from the cache, tokens
computed, completion tokens and time to first token.
"""

from __future__ import annotations

import time

import numpy as np

from statechat.cache.hashing import model_fingerprint
from statechat.config import EngineConfig
from statechat.engine.output import (  # (RequestOutput and StreamEvent: its callers' too)
    RequestOutput,
    StreamEvent,
    cut_at_stop,
    detokenize,
    fast_decode,
    keep_logprobs,
    keep_prompt_logprobs,
    token_end,
)
from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.requests import Requests
from statechat.engine.runner import Launched
from statechat.engine.scheduler import Batch
from statechat.engine.sequence import Sequence, Status
from statechat.engine.setup import EngineSetup, load
from statechat.engine.sizing import cache_sizes, context_limit
from statechat.model.loader import LoadedModel, templated

__all__ = ["LLMEngine", "RequestOutput", "StreamEvent"]


class LLMEngine(Requests, EngineSetup):
    """The engine: requests in (`add_request`, or `generate` and `stream`), one step at a time
    (`step`), outputs out (`output`, `next_event`)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        loaded = load(config) if loaded is None else loaded
        # (a config's chat template replaces the model's for every render)
        self.loaded, self.tokenizer = loaded, templated(loaded.tokenizer, config.chat_template)
        # ids -> text, by skip_special_tokens
        self._decoders = {skip: fast_decode(loaded.tokenizer, skip) for skip in (True, False)}
        num_blocks, num_slots = cache_sizes(config, loaded)
        self.max_model_len = context_limit(config, loaded, num_blocks)
        self._read_model_ends()
        self.fingerprint = model_fingerprint(loaded.config.digest(), loaded.weights_digest,
                                             str(loaded.dtype), config.block_size)
        self._make_runner(num_blocks, num_slots)
        self._make_scheduler(num_blocks, num_slots)
        self._prefill_run: tuple | None = None  # (start, tokens, any capped) of prefill steps
        # that have not synchronised yet (see _time_prefill)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else loaded.device.type == "cuda")
        self._ahead: Launched | None = None  # a decode step queued before the last one's read

    def close(self) -> None:
        """Finish pending cache writes and close the disk tier (call before the process exits).
        An engine used after it goes on from device memory alone."""
        if self.store is not None:
            self.store.engine_busy(False)
            self.prefix.flush_deferred()
            self.store.close()
            self.store = self.prefix.store = None

    # --- requests (add_request, generate, stream: requests.py) ---------------------------
    def abort(self, seq: Sequence) -> None:
        """Stop a request early (a user pressed stop): it finishes with reason 'abort'. Its
        text is then a decode of all its tokens, as a finished reply's is: tokens held back for
        an unfinished character are not lost (nor their place in a stream's last event), and
        a stop string they complete cuts it (the reason then 'stop', as a step would give)."""
        if seq.is_finished:
            return
        reason = "abort"
        if seq.num_text_tokens < len(seq.output_ids):
            shown = len(seq.text)
            detokenize(self._decoders[seq.params.skip_special_tokens], seq, final=True)
            reason = "stop" if cut_at_stop(seq, shown) else reason
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
            seq.finish_reason = reason
            seq.status = Status.FINISHED
        else:
            self.scheduler.finish(seq, reason)  # (its reply-end checkpoint published: saved
            # now, since no step may follow)
            self.prefix.persist(self.scheduler.take_new_checkpoints(), self.fingerprint)
        self.runner.forget(seq.seq_id)
        self._prefill_run = None  # its unsynchronised chunks must not time the next request
        self._forget_ended_ahead()
        self._busy(False)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def drop_device_cache(self) -> None:
        """Forget every cached block and checkpoint of the device tier (no request may run);
        the lower tiers keep theirs: the next request resumes from host memory or disk."""
        if self.scheduler.has_work():
            raise RuntimeError("drop_device_cache needs an idle engine")
        if self.store is not None:
            self.prefix.flush_deferred()  # (they read the pools about to be dropped)
            self.store.flush()  # queued saves still read device snapshots, not the pools
        num_blocks, num_slots = self.scheduler.blocks.num_blocks, self.scheduler.slots.num_slots
        self.scheduler.blocks = self.prefix.blocks = BlockPool(num_blocks)
        self.scheduler.slots = self.prefix.slots = SlotPool(num_slots)
        self.prefix.persisted.clear()
        self.prefix.stored_ckpts.clear()
        self.prefix.disk_checks.clear()

    # --- stepping -----------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one scheduled step; return the sequences that got a token this step (or ended
        without one: a request for none ends with its prompt).

        With async scheduling, a decode step that leaves every sequence running mid-block
        queues the step after it before its own tokens are read (Scheduler.can_continue): the
        device never waits for the host between such steps. That step is the next call's. A
        step with a structured output's row queues that step's forward alone, and its sampling
        at the next call, once this step's tokens are read (the row's mask needs them)."""
        # busy from admission (a restore's disk reads must not share the disk with the writer)
        # until the runner waits for sampled tokens (before_wait)
        self._busy(True)
        ahead, self._ahead = self._ahead, None
        t0, batch = time.perf_counter(), None
        try:
            if ahead is not None:  # (one whose sequences all ended was forgotten: unread)
                launched = ahead
                if launched.pending is not None:  # (its rows' tokens before it are appended)
                    self.runner.sample_pending(launched)
            else:
                batch = self.scheduler.schedule()
                if not batch.items:
                    return self._no_step()
                launched = self.runner.launch(batch)
            batch = launched.batch
            if self.async_scheduling and self.scheduler.can_continue(batch, self.max_model_len):
                held = any(it.seq.params.uses_grammar for it in batch.items)  # (their masks
                # need this step's tokens: the step after samples once they are read)
                self._ahead = self.runner.launch(self.scheduler.continuation(batch),
                                                 after=launched, defer=held)
            tokens, logprobs, prompt = self.runner.collect(launched)  # (its one synchronisation)
            synchronised = bool(tokens) or prompt is not None
            if not synchronised and all(it.seq.speculative for it in batch.items):
                synchronised = self.runner.finish()  # (work done ahead: see ModelRunner.finish)
        except BaseException:
            self._busy(False)
            self._ahead = None
            if batch is not None:  # (its checkpoint targets hold no state anyone computed)
                self.scheduler.drop_targets(batch)
            raise
        return self._postprocess(batch, tokens, logprobs, prompt, t0, synchronised)

    def _no_step(self) -> list[Sequence]:
        """A schedule with nothing to run: the engine is idle (no sequence got a token), or,
        if work is left, stuck (an error: nothing it holds can ever be freed)."""
        self._busy(False)
        self._prefill_run = None
        if self.scheduler.has_work():
            raise RuntimeError("the scheduler could not make progress (cache too small?)")
        return []

    def _postprocess(self, batch: Batch, tokens: list[int], logprobs: list | None,
                     prompt: np.ndarray | None, t0: float, synchronised: bool) -> list[Sequence]:
        """The host's work once a step's tokens are read (its launch at t0): time it, keep its
        logprobs, append its tokens (the scheduler), copy its checkpoints' states, end the
        sequences that finished, and persist new checkpoints; the sequences updated. A failure
        drops the step's copies (and its checkpoint targets, if not yet published) and ends the
        sequences of a step queued ahead (_drop_ahead)."""
        now, posted = time.perf_counter(), False
        try:
            self._time_prefill(batch, t0, now, synchronised)
            updated = [it.seq for it in batch.items if it.needs_logits and not it.seq.is_finished]
            if logprobs is not None:
                keep_logprobs(batch, logprobs)
            if prompt is not None:
                keep_prompt_logprobs(batch, self.runner.scored(batch), prompt)
            copies, posted = self.scheduler.postprocess(batch, tokens), True
            self.runner.copy_slots(copies)
            self.scheduler.copied()  # (on a failure, drop_copies: no checkpoint of a failed copy)
            for seq in updated:
                if seq.first_token_time is None:
                    seq.first_token_time = now
                seq.last_token_time = now
                self._check_finish(seq)
            if not batch.is_decode:
                self._end_tokenless(batch, updated)
            self.prefix.persist(self.scheduler.take_new_checkpoints(), self.fingerprint)
            self._forget_ended_ahead()
            if not self.scheduler.has_work():  # (a run of prompts that sampled nothing, as a
                # warm-up's, is never timed: the next request's must not count the idle gap)
                self._prefill_run = None
        except BaseException:
            self.scheduler.drop_copies()
            if not posted:  # (its checkpoint slots are neither published nor given back)
                self.scheduler.drop_targets(batch)
            self._drop_ahead()
            raise
        return updated

    def _end_tokenless(self, batch: Batch, updated: list[Sequence]) -> None:
        """End (reason 'length') each request of a prefill step that asked for no tokens and
        whose prompt is now computed, adding it to `updated`: it ends with its prompt."""
        for it in batch.items:
            seq = it.seq
            if not seq.params.max_tokens and not seq.is_finished and seq.num_uncomputed == 0:
                self.scheduler.finish(seq, "length")
                self.runner.forget(seq.seq_id)
                updated.append(seq)

    def _forget_ended_ahead(self) -> None:
        """Forget the step queued ahead once its sequences have all ended (a stop token, an
        abort): its tokens are never read, and an idle engine holds no step."""
        if self._ahead is not None and all(it.seq.is_finished for it in self._ahead.batch.items):
            self._ahead = None

    def _drop_ahead(self) -> None:
        """After a step failed past its tokens' read: the step queued after it has moved its
        sequences' GDN states on without their bookkeeping, so they cannot go on; end them."""
        ahead, self._ahead = self._ahead, None
        for it in ahead.batch.items if ahead is not None else []:
            if not it.seq.is_finished:
                self.abort(it.seq)

    def _busy(self, busy: bool) -> None:
        """Tell the cache's writer whether a step is being launched: a step that samples stays
        busy until its tokens are awaited; a prefill chunk that samples nothing stays busy into
        the next step, which follows at once."""
        if self.store is not None:
            self.store.engine_busy(busy)

    def _time_prefill(self, batch, t0: float, now: float, synchronised: bool) -> None:
        """Feed the cost model's prefill rate. A step that samples nothing returns before the
        device is done, so prefill steps are timed together, from the first one to the next step
        that reads sampled tokens (a prompt's last chunk, or a decode)."""
        if not batch.is_decode:
            start, tokens, capped = self._prefill_run or (t0, 0, False)
            self._prefill_run = (start, tokens + batch.num_tokens, capped or batch.capped)
        if synchronised and self._prefill_run is not None:
            self.prefix.cost.observe_prefill(self._prefill_run[1], now - self._prefill_run[0],
                                             self._prefill_run[2])
            self._prefill_run = None

    def _check_finish(self, seq: Sequence) -> None:
        reason, stop_token = token_end(seq, self.eos_ids, self.eos_token_id, self.max_model_len)
        shown = len(seq.text)
        # the stop token's id stays in the reply, its text does not unless the request keeps
        # stops (vLLM's, as with a stop string)
        detokenize(self._decoders[seq.params.skip_special_tokens], seq,
                   final=reason is not None,
                   drop_last=stop_token and not seq.params.include_stop_str_in_output)
        if cut_at_stop(seq, shown):
            reason = "stop"
        if reason:
            self.scheduler.finish(seq, reason)
            self.runner.forget(seq.seq_id)
