"""LLMEngine: the glue between tokenizer, scheduler, pools and model runner.

    engine = LLMEngine(EngineConfig(model=path))
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32))
    for event in engine.stream(prompt_ids, params): ...

(The request API, generate and stream among it, is requests.py's; n samples, samples.py's.)

Every finished request reports its prompt tokens, tokens reused from the cache, tokens
computed, completion tokens and time to first token.
"""

from __future__ import annotations

import logging
import time

import torch

from statechat.cache.hashing import model_fingerprint
from statechat.cache.store import StateStore, open_store
from statechat.config import MIN_STATE_SLOTS, EngineConfig
from statechat.devices import default_dtype, resolve_device
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
from statechat.engine.prefix import PrefixCache
from statechat.engine.requests import Requests
from statechat.engine.runner import Launched, ModelRunner
from statechat.engine.sampling import SamplingParams
from statechat.engine.scheduler import Scheduler
from statechat.engine.sequence import Sequence, Status
from statechat.engine.sizing import cache_sizes, context_limit, prefill_guess
from statechat.model.context import ModelCaches
from statechat.model.loader import LoadedModel, load_model
from statechat.paths import served_name

__all__ = ["LLMEngine", "RequestOutput", "StreamEvent"]
log = logging.getLogger("statechat.engine")


class LLMEngine(Requests):
    """The engine: requests in (`add_request`, or `generate` and `stream`), one step at a time
    (`step`), outputs out (`output`, `next_event`)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if loaded is None:
            device = resolve_device(config.device)
            dtype = getattr(torch, config.dtype) if config.dtype else default_dtype(device)
            loaded = load_model(config.model, dtype=dtype, device=device)
        self.loaded, self.tokenizer = loaded, loaded.tokenizer
        # ids -> text, by skip_special_tokens
        self._decoders = {skip: fast_decode(loaded.tokenizer, skip) for skip in (True, False)}
        mc = loaded.config
        num_blocks, num_slots = cache_sizes(config, loaded)
        bs = config.block_size
        self.max_model_len = context_limit(config, loaded, num_blocks)
        # the tokenizer's EOS ends a reply with no stop_reason; the model's others (a list in
        # generation_config.json: Qwen's <|endoftext|> beside <|im_end|>) end it as stop
        # tokens do, naming their id (vLLM's)
        self.eos_token_id = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_ids = set(mc.eos_token_ids) | {self.eos_token_id} - {None}
        # a request given no params samples as the checkpoint recommends (its
        # generation_config.json), the other fields SamplingParams' defaults: vLLM's
        # LLM.generate without sampling_params
        self.default_params = SamplingParams(**dict(mc.sampling_defaults))
        self.fingerprint = model_fingerprint(mc.digest(), loaded.weights_digest, str(loaded.dtype),
                                             bs)
        self.runner = ModelRunner(loaded, num_blocks, num_slots, bs)
        self.runner.eos_ids = self.eos_ids
        self.store = self._open_store()
        if self.store is not None:  # the store's method, not the engine's: no reference cycle
            self.runner.before_wait = self.store.engine_idle.set
        blocks, slots = BlockPool(num_blocks), SlotPool(num_slots - 1)  # the last is the pad slot
        if config.enable_prefix_cache and num_slots <= MIN_STATE_SLOTS:
            log.warning("statechat: %d state slots leave none for checkpoints, so the prefix "
                        "cache reuses nothing; give num_state_slots %d or more", num_slots,
                        MIN_STATE_SLOTS + 1)
        self.runner.prepare_steps(config.use_graphs, config.max_num_seqs, self.max_model_len,
                                  config.max_num_batched_tokens)
        self.prefix = PrefixCache(
            blocks, slots, self.runner, self.store, bs,
            ModelCaches.bytes_per_block(mc, loaded.dtype, bs),
            ModelCaches.bytes_per_slot(mc, loaded.dtype), prefill_guess(loaded),
        )
        self.prefix.calibrate()
        self.scheduler = Scheduler(
            blocks, slots, self.prefix, self.fingerprint, bs, config.max_num_seqs,
            config.max_num_batched_tokens, config.checkpoint_interval, config.enable_prefix_cache,
            config.step_target_s(loaded.device.type),
        )
        self._prefill_run: tuple | None = None  # (start, tokens, any capped) of prefill steps
        # that have not synchronised yet (see _time_prefill)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else loaded.device.type == "cuda")
        self._ahead: Launched | None = None  # a decode step queued before the last one's read

    def _open_store(self) -> StateStore | None:
        cfg = self.config
        if cfg.cache_dir is None or not cfg.enable_prefix_cache:
            return None
        store = open_store(cfg.cache_dir, cfg.disk_cache_bytes, cfg.host_cache_bytes)
        store.attach(self.fingerprint.hex(), served_name(self.loaded.path), str(self.loaded.path),
                     str(self.loaded.dtype), cfg.block_size, self.runner.state_shapes(),
                     device=self.loaded.device)
        return store

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
        device never waits for the host between such steps. That step is the next call's."""
        # busy from admission (a restore's disk reads must not share the disk with the writer)
        # until the runner waits for sampled tokens (before_wait)
        self._busy(True)
        ahead, self._ahead = self._ahead, None
        t0, batch = time.perf_counter(), None
        try:
            if ahead is not None:  # (one whose sequences all ended was forgotten: unread)
                launched = ahead
            else:
                batch = self.scheduler.schedule()
                if not batch.items:
                    self._busy(False)
                    self._prefill_run = None
                    if self.scheduler.has_work():
                        raise RuntimeError(
                            "the scheduler could not make progress (cache too small?)")
                    return []
                launched = self.runner.launch(batch)
            batch = launched.batch
            if self.async_scheduling and self.scheduler.can_continue(batch, self.max_model_len):
                self._ahead = self.runner.launch(self.scheduler.continuation(batch), after=launched)
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
            for it in [] if batch.is_decode else batch.items:  # a request for no tokens ends
                seq = it.seq  # with its prompt (a prefill step's)
                if not seq.params.max_tokens and not seq.is_finished and seq.num_uncomputed == 0:
                    self.scheduler.finish(seq, "length")
                    self.runner.forget(seq.seq_id)
                    updated.append(seq)
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
