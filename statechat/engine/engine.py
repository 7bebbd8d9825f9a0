"""LLMEngine: the glue between tokenizer, scheduler, pools and model runner.

    engine = LLMEngine(EngineConfig(model=path))
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32))
    for event in engine.stream(prompt_ids, params): ...

Every finished request reports its prompt tokens, tokens reused from the cache, tokens
computed, completion tokens and time to first token.
"""

from __future__ import annotations

import collections.abc
import contextlib
import logging
import struct
import time
from collections.abc import Iterator

import numpy as np
import torch

from statechat.cache.hashing import int32_bytes, model_fingerprint
from statechat.cache.store import StateStore, open_store
from statechat.config import MIN_STATE_SLOTS, EngineConfig
from statechat.devices import default_dtype, free_memory, graph_api, resolve_device
from statechat.engine.output import (
    RequestOutput,
    StreamEvent,
    cut_at_stop,
    detokenize,
    fast_decode,
    keep_logprobs,
    keep_prompt_logprobs,
    next_event,
    request_output,
)
from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.prefix import PrefixCache
from statechat.engine.runner import Launched, ModelRunner
from statechat.engine.sampling import SamplingParams, check_vocabulary
from statechat.engine.scheduler import Scheduler
from statechat.engine.sequence import Sequence, Status
from statechat.errors import ConfigError, ContextLengthError
from statechat.model.context import ModelCaches
from statechat.model.loader import LoadedModel, load_model

log = logging.getLogger("statechat.engine")


def check_context_limit(asked: int, positions: int) -> None:
    """A one-line ConfigError for a context limit past the model's positions."""
    if asked > positions:
        raise ConfigError(f"max_model_len {asked:,} exceeds the model's {positions:,} positions; "
                          "lower max_model_len")


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if loaded is None:
            device = resolve_device(config.device)
            dtype = getattr(torch, config.dtype) if config.dtype else default_dtype(device)
            loaded = load_model(config.model, dtype=dtype, device=device)
        self.loaded, self.tokenizer = loaded, loaded.tokenizer
        self._decode = fast_decode(loaded.tokenizer)
        mc = loaded.config
        num_blocks, num_slots = self._cache_sizes()
        bs = config.block_size
        self.max_model_len = self._context_limit(num_blocks)
        self.eos_ids = set(mc.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
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
        use_graphs = (loaded.device.type == "cuda" if config.use_graphs is None
                      else config.use_graphs)
        if use_graphs and graph_api(loaded.device) is not None:
            max_blocks = (self.max_model_len + bs - 1) // bs
            self.runner.capture_graphs(min(config.max_num_seqs, 512), max_blocks,
                                       config.max_num_batched_tokens)
        elif use_graphs and loaded.device.type == "npu":
            log.warning("statechat: this torch_npu has no graph capture (torch.npu.NPUGraph); "
                        "steps run eagerly")
        if loaded.device.type != "cpu":
            self.runner.warm_up(config.max_num_seqs, config.max_num_batched_tokens,
                                -(-self.max_model_len // bs))
        self.prefix = PrefixCache(
            blocks, slots, self.runner, self.store, bs,
            ModelCaches.bytes_per_block(mc, loaded.dtype, bs),
            ModelCaches.bytes_per_slot(mc, loaded.dtype), self._prefill_guess(),
        )
        self.prefix.calibrate()
        self.scheduler = Scheduler(
            blocks, slots, self.prefix, self.fingerprint, bs, config.max_num_seqs,
            config.max_num_batched_tokens, config.checkpoint_interval, config.enable_prefix_cache,
        )
        self._prefill_run: tuple[float, int] | None = None  # (start, tokens) of prefill steps
        # that have not synchronised yet (see _time_prefill)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else loaded.device.type == "cuda")
        self._ahead: Launched | None = None  # a decode step queued before the last one's read

    def _open_store(self) -> StateStore | None:
        cfg = self.config
        if cfg.cache_dir is None or not cfg.enable_prefix_cache:
            return None
        store = open_store(cfg.cache_dir, cfg.disk_cache_bytes, cfg.host_cache_bytes)
        store.attach(self.fingerprint.hex(), self.loaded.path.name, str(self.loaded.path),
                     str(self.loaded.dtype), cfg.block_size, self.runner.state_shapes(),
                     device=self.loaded.device)
        return store

    def _prefill_guess(self) -> float:
        """Seconds per prefill token before any is measured: 2 FLOPs per weight at a typical
        rate."""
        params = sum(p.numel() for p in self.loaded.model.parameters())
        flops_per_s = 5e10 if self.loaded.device.type == "cpu" else 3e14
        return max(2 * params / flops_per_s, 2e-5 if self.loaded.device.type == "cpu" else 2e-7)

    def close(self) -> None:
        """Finish pending cache writes (call before the process exits)."""
        if self.store is not None:
            self.store.engine_busy(False)
            self.prefix.flush_deferred()
            self.store.close()

    def _cache_sizes(self) -> tuple[int, int]:
        """KV blocks and GDN slots: explicit counts, else a share of the memory budget."""
        cfg, mc, dtype = self.config, self.loaded.config, self.loaded.dtype
        per_slot = ModelCaches.bytes_per_slot(mc, dtype)
        per_block = ModelCaches.bytes_per_block(mc, dtype, cfg.block_size)
        if self.loaded.device.type == "cpu":
            budget = cfg.cpu_cache_bytes
        else:
            budget = int(free_memory(self.loaded.device) * cfg.memory_fraction)
        slots = cfg.num_state_slots or max(2 * cfg.max_num_seqs + 2,
                                           min(4096, budget // 4 // per_slot))
        blocks = cfg.num_kv_blocks or (budget - slots * per_slot) // max(per_block, 1)
        if blocks < 2 or slots < 2:
            raise ConfigError("not enough memory for the KV and state caches; lower max_num_seqs")
        return int(blocks), int(slots)

    def _context_limit(self, num_blocks: int) -> int:
        """Tokens a sequence may hold (prompt and reply): the config's, which neither the model's
        positions nor the KV cache may fall short of (a one-line ConfigError), else the model's,
        capped at what the KV cache holds."""
        cfg, positions = self.config, self.loaded.config.max_position_embeddings
        held = num_blocks * cfg.block_size
        if cfg.max_model_len is None:
            return min(positions, held)
        check_context_limit(cfg.max_model_len, positions)
        if cfg.max_model_len > held:
            more = ("or raise num_kv_blocks" if cfg.num_kv_blocks else
                    f"(on the CPU the caches take {cfg.cpu_cache_bytes / 2**30:g} GiB)"
                    if self.loaded.device.type == "cpu" else "or raise memory_fraction")
            raise ConfigError(f"the KV cache holds {held:,} tokens, fewer than max_model_len "
                              f"{cfg.max_model_len:,}; lower max_model_len {more}")
        return cfg.max_model_len

    # --- requests -----------------------------------------------------------------------
    def encode(self, prompt: str | list[int] | np.ndarray) -> list[int]:
        """A prompt's token ids: a string is tokenized; a list, tuple or 1-D integer numpy array
        of ids is taken as it is (check_prompt checks the ids); anything else is a one-line
        ConfigError."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, np.ndarray) and prompt.ndim == 1 and (
                prompt.size == 0 or np.issubdtype(prompt.dtype, np.integer)):
            return prompt.tolist()
        if (isinstance(prompt, collections.abc.Sequence)
                and not isinstance(prompt, bytes | bytearray)):
            return list(prompt)
        raise ConfigError("a prompt must be a string or a list of token ids, got "
                          f"{_describe(prompt)}")

    def check_prompt(self, prompt: str | list[int]) -> tuple[list[int], bytes]:
        """The prompt's token ids and their int32 bytes (what the block hashes read), checked: a
        one-line ConfigError for an empty prompt, one that leaves no room in the context, or an
        id that is not an integer of the model's vocabulary (one past the embedding table is,
        on a GPU, an assert that ends the process). Reads no state that requests change: any
        thread may call it."""
        ids = self.encode(prompt)
        if not ids:
            raise ConfigError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens; the context limit is {self.max_model_len}"
            )
        vocab = self.loaded.config.vocab_size
        try:
            packed = int32_bytes(ids)
        except struct.error:
            raise ConfigError(f"token ids must be integers from 0 to {vocab - 1}") from None
        as_array = np.frombuffer(packed, dtype=np.int32)
        if as_array.min() < 0 or as_array.max() >= vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ConfigError(
                f"token id {bad} is outside the model's vocabulary (0 to {vocab - 1})"
            )
        return ids, packed

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str = ""
    ) -> Sequence:
        return self.add_checked(*self.check_prompt(prompt), params, request_id)

    def add_checked(
        self, ids: list[int], packed: bytes, params: SamplingParams | None = None,
        request_id: str = "",
    ) -> Sequence:
        """Queue a prompt that `check_prompt` passed, with the bytes it returned."""
        params = SamplingParams() if params is None else params
        check_vocabulary(params, self.loaded.config.vocab_size)
        seq = Sequence(ids, params, request_id=request_id)
        self.scheduler.add(seq, packed)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a request early (a user pressed stop): it finishes with reason 'abort'."""
        if seq.is_finished:
            return
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
            seq.finish_reason = "abort"
            seq.status = Status.FINISHED
        else:
            self.scheduler.finish(seq, "abort")  # (its reply-end checkpoint published: saved
            # now, since no step may follow)
            self.prefix.persist(self.scheduler.take_new_checkpoints(), self.fingerprint)
        self.runner.forget(seq.seq_id)
        self._prefill_run = None  # its unsynchronised chunks must not time the next request
        self._busy(False)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def drop_device_cache(self) -> None:
        """Forget every cached block and checkpoint of the device tier (no request may run).

        The lower tiers keep theirs: the next request resumes from host memory or disk.
        """
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
        t0 = time.perf_counter()
        try:
            if ahead is not None and any(not it.seq.is_finished for it in ahead.batch.items):
                launched = ahead
            else:  # (a continuation whose sequences all ended is dropped unread)
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
            tokens, logprobs, prompt = self.runner.collect(launched)  # (the step's one
            # synchronisation)
        except BaseException:
            self._busy(False)
            self._ahead = None
            raise
        now = time.perf_counter()
        try:
            self._time_prefill(batch, t0, now, synchronised=bool(tokens) or prompt is not None)
            updated = [it.seq for it in batch.items if it.needs_logits and not it.seq.is_finished]
            if logprobs is not None:
                keep_logprobs(batch, logprobs)
            if prompt is not None:
                keep_prompt_logprobs(batch, self.runner.scored(batch), prompt)
            self.runner.copy_slots(self.scheduler.postprocess(batch, tokens))
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
        except BaseException:
            self._drop_ahead()
            raise
        return updated

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
            start, tokens = self._prefill_run or (t0, 0)
            self._prefill_run = (start, tokens + batch.num_tokens)
        if synchronised and self._prefill_run is not None:
            start, tokens = self._prefill_run
            self.prefix.cost.observe_prefill(tokens, now - start)
            self._prefill_run = None

    def _check_finish(self, seq: Sequence) -> None:
        p, token = seq.params, seq.token_ids[-1]
        reason = None
        stop_token = (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids
        if stop_token:
            reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        shown = len(seq.text)
        # the stop token's id stays in the reply, its text does not (vLLM's, as with a stop
        # string)
        detokenize(self._decode, seq, final=reason is not None, drop_last=stop_token)
        if cut_at_stop(seq, shown):
            reason = "stop"
        if reason:
            self.scheduler.finish(seq, reason)
            self.runner.forget(seq.seq_id)

    def output(self, seq: Sequence) -> RequestOutput:
        """What `seq` has made so far (all of it once it has finished)."""
        return request_output(seq)

    def next_event(
        self, seq: Sequence, sent_text: int, sent_tokens: int
    ) -> tuple[StreamEvent | None, int, int]:
        """A stream's next event for `seq` (see output.next_event)."""
        return next_event(seq, sent_text, sent_tokens)

    # --- convenience --------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts together (continuous batching); outputs in input order. On an error
        (a bad prompt or params, or a failed step) none of them stays queued."""
        if not isinstance(prompts, list | tuple):
            raise ConfigError("generate takes a list of prompts "
                              "(each a string or a list of token ids)")
        params = SamplingParams() if params is None else params
        plist = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        plist = [SamplingParams() if sp is None else sp for sp in plist]
        checked = [self.check_prompt(p) for p in prompts]  # all checked before any is queued
        for sp in plist:
            check_vocabulary(sp, self.loaded.config.vocab_size)
        seqs = []
        try:
            for (ids, packed), sp in zip(checked, plist):
                seqs.append(self.add_checked(ids, packed, sp))
            while self.has_unfinished():
                self.step()
        except BaseException:
            for seq in seqs:
                with contextlib.suppress(Exception):  # (the first error is the one to report)
                    self.abort(seq)
            raise
        return [self.output(s) for s in seqs]

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Iterator[StreamEvent]:
        """Generate one request, yielding text deltas as they are decoded."""
        seq = self.add_request(prompt, params)
        sent_text, sent_tokens = 0, 0
        try:
            while True:
                # (another caller may have stepped the engine, even to this request's end,
                # while an event was out: what it made is sent before any step of this one)
                if seq.num_text_tokens <= sent_tokens and not seq.is_finished:
                    self.step()
                if seq.num_text_tokens > sent_tokens or seq.is_finished:
                    is_last = seq.is_finished  # (its event carries the output)
                    event, sent_text, sent_tokens = self.next_event(seq, sent_text, sent_tokens)
                    if event is not None:
                        yield event
                    if is_last:
                        return
        finally:
            self.abort(seq)


def _describe(value) -> str:
    """What a value that is not a prompt is, for an error message."""
    if value is None:
        return "None"
    if isinstance(value, np.ndarray):
        return f"a {value.ndim}-D {value.dtype} numpy array"
    return type(value).__name__
