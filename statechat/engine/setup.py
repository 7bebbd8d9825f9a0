"""LLMEngine's construction, in the order it runs: the model loaded (unless given), what the
engine reads from it (stop ids, default sampling), the runner and the disk tier, then the pools,
the runner's graphs, the prefix cache and the scheduler.

A mixin of LLMEngine (engine/engine.py), whose `__init__` calls these once.
"""

from __future__ import annotations

import logging

import torch

from statechat.cache.store import StateStore, open_store
from statechat.config import MIN_STATE_SLOTS, EngineConfig
from statechat.devices import default_dtype, resolve_device
from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.prefix import PrefixCache
from statechat.engine.runner import ModelRunner
from statechat.engine.sampling import SamplingParams
from statechat.engine.scheduler import Scheduler
from statechat.engine.sizing import prefill_guess
from statechat.engine.structured import Grammars
from statechat.model.context import ModelCaches
from statechat.model.loader import LoadedModel, load_model
from statechat.paths import served_name

log = logging.getLogger("statechat.engine")


def load(config: EngineConfig) -> LoadedModel:
    """The model of `config`, on its device (resolved) in its dtype (the device's default when
    it names none)."""
    device = resolve_device(config.device)
    dtype = getattr(torch, config.dtype) if config.dtype else default_dtype(device)
    return load_model(config.model, dtype=dtype, device=device,
                      chat_template=config.chat_template)


class EngineSetup:
    """The construction steps of LLMEngine (see the module docstring); each sets attributes
    that the later ones and the engine read."""

    config: EngineConfig
    loaded: LoadedModel
    fingerprint: bytes

    def _read_model_ends(self) -> None:
        """Set `eos_token_id`, `eos_ids` and `default_params` from the tokenizer and the model's
        generation config."""
        mc = self.loaded.config
        # the tokenizer's EOS ends a reply with no stop_reason; the model's others (a list in
        # generation_config.json: Qwen's <|endoftext|> beside <|im_end|>) end it as stop
        # tokens do, naming their id (vLLM's)
        self.eos_token_id = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_ids = set(mc.eos_token_ids) | {self.eos_token_id} - {None}
        # a request given no params samples as the checkpoint recommends (its
        # generation_config.json), the other fields SamplingParams' defaults: vLLM's
        # LLM.generate without sampling_params
        self.default_params = SamplingParams(**dict(mc.sampling_defaults))

    def _make_runner(self, num_blocks: int, num_slots: int) -> None:
        """Set `runner` (its caches allocated) and `store` (the disk tier, or None), the
        runner's wait telling the store's writer that the engine is idle."""
        self.runner = ModelRunner(self.loaded, num_blocks, num_slots, self.config.block_size)
        self.runner.eos_ids = self.eos_ids
        self.runner.grammars = Grammars(self.tokenizer, self.loaded.config.vocab_size,
                                        self.eos_ids)
        self.store = self._open_store()
        if self.store is not None:  # the store's method, not the engine's: no reference cycle
            self.runner.before_wait = self.store.engine_idle.set

    def _open_store(self) -> StateStore | None:
        cfg = self.config
        if cfg.cache_dir is None or not cfg.enable_prefix_cache:
            return None
        store = open_store(cfg.cache_dir, cfg.disk_cache_bytes, cfg.host_cache_bytes)
        store.attach(self.fingerprint.hex(), served_name(self.loaded.path), str(self.loaded.path),
                     str(self.loaded.dtype), cfg.block_size, self.runner.state_shapes(),
                     device=self.loaded.device)
        return store

    def _make_scheduler(self, num_blocks: int, num_slots: int) -> None:
        """Make the pools, prepare the runner's steps (graphs, warm-up), and set `prefix` (its
        disk rate calibrated) and `scheduler` over them."""
        config, loaded, bs = self.config, self.loaded, self.config.block_size
        mc = loaded.config
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
