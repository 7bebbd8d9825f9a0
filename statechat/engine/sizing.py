"""How big an engine's caches are and how long its sequences may be, from the config, the
loaded model and the device's free memory. Plain functions of those three, read once when
`LLMEngine` starts."""

from __future__ import annotations

from statechat.config import EngineConfig
from statechat.devices import free_memory
from statechat.errors import ConfigError
from statechat.model.context import ModelCaches
from statechat.model.loader import LoadedModel


def check_context_limit(asked: int, positions: int) -> None:
    """A one-line ConfigError for a context limit past the model's positions."""
    if asked > positions:
        raise ConfigError(f"max_model_len {asked:,} exceeds the model's {positions:,} positions; "
                          "lower max_model_len")


def cache_sizes(cfg: EngineConfig, loaded: LoadedModel) -> tuple[int, int]:
    """KV blocks and GDN slots: explicit counts, else a share of the memory budget (on the CPU
    `cpu_cache_bytes`, elsewhere `memory_fraction` of the free device memory)."""
    mc, dtype = loaded.config, loaded.dtype
    per_slot = ModelCaches.bytes_per_slot(mc, dtype)
    per_block = ModelCaches.bytes_per_block(mc, dtype, cfg.block_size)
    if loaded.device.type == "cpu":
        budget = cfg.cpu_cache_bytes
    else:
        budget = int(free_memory(loaded.device) * cfg.memory_fraction)
    slots = cfg.num_state_slots or max(2 * cfg.max_num_seqs + 2,
                                       min(4096, budget // 4 // per_slot))
    blocks = cfg.num_kv_blocks or (budget - slots * per_slot) // max(per_block, 1)
    if blocks < 2 or slots < 2:
        more = (f"raise cpu_cache_bytes ({cfg.cpu_cache_bytes:,}) or "
                if loaded.device.type == "cpu" and not cfg.num_kv_blocks else "")
        raise ConfigError(f"not enough memory for the KV and state caches; {more}lower "
                          "max_num_seqs")
    return int(blocks), int(slots)


def context_limit(cfg: EngineConfig, loaded: LoadedModel, num_blocks: int) -> int:
    """Tokens a sequence may hold (prompt and reply): the config's, which neither the model's
    positions nor the KV cache may fall short of (a one-line ConfigError), else the model's,
    capped at what the KV cache holds."""
    positions = loaded.config.max_position_embeddings
    held = num_blocks * cfg.block_size
    if cfg.max_model_len is None:
        return min(positions, held)
    check_context_limit(cfg.max_model_len, positions)
    if cfg.max_model_len > held:
        more = ("or raise num_kv_blocks" if cfg.num_kv_blocks else
                f"(on the CPU the caches take {cfg.cpu_cache_bytes / 2**30:g} GiB)"
                if loaded.device.type == "cpu" else "or raise memory_fraction")
        raise ConfigError(f"the KV cache holds {held:,} tokens, fewer than max_model_len "
                          f"{cfg.max_model_len:,}; lower max_model_len {more}")
    return cfg.max_model_len


def prefill_guess(loaded: LoadedModel) -> float:
    """Seconds per prefill token before any is measured: 2 FLOPs per weight at a typical rate
    (the cost model's start), and no less than a tiny model's per-token overheads (the
    embedded model's prefill measured about 7e-5 s a token on a 2-core CPU: a 2e-5 floor priced
    recomputing a restored prefix 3.5x too cheap, so a fresh engine recomputed what it would
    have loaded faster)."""
    params = sum(p.numel() for p in loaded.model.parameters())
    is_cpu = loaded.device.type == "cpu"
    flops_per_s = 5e10 if is_cpu else 3e14
    return max(2 * params / flops_per_s, 7e-5 if is_cpu else 2e-7)
