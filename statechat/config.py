"""Engine configuration: one frozen, validated dataclass built once (by the CLI, TUI or tests)."""

from __future__ import annotations

import contextlib
import numbers
import os
import re
from dataclasses import dataclass
from pathlib import Path

from statechat.errors import ConfigError
from statechat.paths import resolve_model

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")
# the variable that picks which of an accelerator kind's devices a process sees
VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def check_device_name(name: str) -> None:
    """A one-line ConfigError for a device name statechat does not know (whether the device is
    there is devices.resolve_device's question)."""
    if name in DEVICE_CHOICES:
        return
    kind, colon, index = str(name).partition(":")
    if colon and kind in VISIBLE_DEVICES and index.isdigit():  # (torch's `cuda:1`)
        raise ConfigError(f"device {name!r}: statechat runs on one device of a kind; pass "
                          f"--device {kind} and pick that one with {VISIBLE_DEVICES[kind]}={index}")
    raise ConfigError(f"unknown device {name!r:.40}; choose one of {', '.join(DEVICE_CHOICES)}")


# GDN state slots the engine cannot run with fewer of: slot 0 (the null slot: zeros), the pad
# slot (padding rows of graph replays write it) and one running sequence's working state
# (checkpoints and a reply's pending boundary state take a slot only when one is free)
MIN_STATE_SLOTS = 3

# the default max_step_ms on the CPU: a stream's gaps while a long prompt arrives, its chunks
# cut to it (docs/bench.md measures them)
CPU_STEP_MS = 200.0

# EngineConfig fields that the command line sets, as its flags (--max-model-len ...)
FLAG_FIELDS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "memory_fraction",
               "disk_cache_bytes", "max_step_ms", "chat_template", "dtype")
# a field's name as a word of its own (not inside a path), dtype only where it leads
_FIELD_WORD = re.compile(rf"(?<![\w/.-])({'|'.join(FLAG_FIELDS[:-1])})(?![\w/])|^(dtype)\b")


@contextlib.contextmanager
def flags_named():
    """For the command line (and its app): a ConfigError raised inside names the flags that set
    the fields it names (`--memory-fraction must be in ...`); its type and traceback stay."""
    try:
        yield
    except ConfigError as e:
        e.args = (_FIELD_WORD.sub(lambda m: "--" + m.group(m.lastindex).replace("_", "-"), str(e)),)
        raise


@dataclass(frozen=True)
class EngineConfig:
    model: Path  # checkpoint directory
    device: str = "auto"  # auto | cpu | cuda | npu
    dtype: str | None = None  # None (or vLLM's "auto"): float32 on the CPU, bfloat16 on
    # accelerators; a torch dtype is taken as its name
    block_size: int = 64  # tokens per KV block and checkpoint granularity (a multiple of 64)
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 4096  # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None  # None: the model's positions, capped at the KV cache's
    num_kv_blocks: int | None = None  # None: sized from memory_fraction
    # GDN slots incl. checkpoints (at least 3); None: sized from memory
    num_state_slots: int | None = None
    memory_fraction: float = 0.85  # of free accelerator memory for the caches
    cpu_cache_bytes: int = 1 << 30  # cache budget on the CPU backend
    enable_prefix_cache: bool = True
    # decode steps and one-sequence prefill chunks replay graphs (None: on with CUDA; off on
    # NPUs, where torch_npu's NPU graphs have not run with these kernels yet: True opts in, and
    # a capture that raises there leaves its steps eager; off on the CPU, which has none)
    use_graphs: bool | None = None
    # queue a decode step before the last one's tokens are read, so the device does not wait
    # for the host between steps (None: on with CUDA; off on the CPU, where it saves nothing
    # and a reply that stops costs one more step, and on NPUs, where it has not run yet)
    async_scheduling: bool | None = None
    cache_dir: Path | None = None  # persistent disk tier (None = device tier only)
    disk_cache_bytes: int | None = None  # disk budget; None = 10% of the free space and
    # the cache's own blobs, at start
    # host tier between device and disk: a first-in-first-out ring of this many bytes,
    # allocated (pinned on an accelerator) when the engine starts
    host_cache_bytes: int = 4 << 30
    checkpoint_interval: int = 32  # blocks between checkpoints inside long prefills (0 = off)
    # while replies decode, a step's prefill chunk is cut so that the step's predicted time
    # (the measured prefill rate) stays under this many ms: a long prompt that arrives does not
    # stall the streams for a whole budget's chunk (None: 200 on the CPU, where a 4,096-token
    # chunk takes seconds; 0, and None on accelerators: off, the budget alone)
    max_step_ms: float | None = None
    # a chat template's text that replaces the tokenizer's for every render (None: its own)
    chat_template: str | None = None

    def step_target_s(self, device_type: str) -> float:
        """Seconds a step with decodes should stay under on a device of `device_type` (0: no
        limit but the token budget)."""
        if self.max_step_ms is None:
            return CPU_STEP_MS / 1e3 if device_type == "cpu" else 0.0
        return self.max_step_ms / 1e3

    def __post_init__(self) -> None:
        self._check_types()
        check_device_name(self.device)
        if self.block_size <= 0 or self.block_size % 64:
            raise ConfigError("block_size must be a positive multiple of 64, "
                              f"got {self.block_size}")
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError(f"max_num_batched_tokens must be at least one block "
                              f"({self.block_size} tokens), got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2 tokens, got {self.max_model_len}")
        if not 0.05 <= self.memory_fraction <= 0.98:
            raise ConfigError("memory_fraction must be in [0.05, 0.98], "
                              f"got {self.memory_fraction}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError("num_kv_blocks must be at least 2")
        if self.num_state_slots is not None and self.num_state_slots < MIN_STATE_SLOTS:
            raise ConfigError(f"num_state_slots must be at least {MIN_STATE_SLOTS} (the null "
                              f"slot, the pad slot and one running sequence's state), got "
                              f"{self.num_state_slots}")
        if self.max_step_ms is not None and not self.max_step_ms >= 0:
            raise ConfigError(f"max_step_ms must be 0 (off) or more, got {self.max_step_ms}")
        if self.checkpoint_interval < 0:
            raise ConfigError("checkpoint_interval must be >= 0")
        if self.chat_template is not None:
            from statechat.chat.template import check_template

            check_template(self.chat_template)
        for name in ("cpu_cache_bytes", "host_cache_bytes", "disk_cache_bytes"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"{name} must be 0 or more, got {getattr(self, name)}")

    def _check_types(self) -> None:
        """A one-line ConfigError for a field of the wrong type (a string, a float count, a
        bool for a number), which would otherwise fail later with a TypeError or be taken;
        numpy integers and floats become Python's, a str path a Path (`~` expanded, as the
        command line's are: a cache dir "~/x" was a folder named `~` in the working one), and a
        model written as a repo id its snapshot in the local Hugging Face cache (resolve_model)."""
        put = object.__setattr__  # (frozen)
        for name in ("model", "cache_dir"):
            value = getattr(self, name)
            if isinstance(value, str | os.PathLike):
                try:
                    path = Path(value).expanduser()
                except RuntimeError:  # (~user of no such user)
                    raise ConfigError(f"{name} {value}: no home folder for its ~") from None
                put(self, name, resolve_model(path) if name == "model" else path)
            elif value is not None or name == "model":
                raise ConfigError(f"{name} must be a path, got {type(value).__name__}")
        for name, optional in _COUNT_FIELDS.items():
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigError(f"{name} must be an integer, got {value!r:.40}")
            put(self, name, int(value))
        value = self.memory_fraction
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(f"memory_fraction must be a number, got {value!r:.40}")
        put(self, "memory_fraction", float(value))
        value = self.max_step_ms
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise ConfigError(f"max_step_ms must be a number, got {value!r:.40}")
        put(self, "max_step_ms", None if value is None else float(value))
        value = self.dtype  # (vLLM's "auto"; a torch.dtype, checked by its name: torch is
        # not imported to build a config)
        if isinstance(value, str) and value == "auto" or type(value).__module__ == "torch":
            put(self, "dtype", None if value == "auto" else str(value).removeprefix("torch."))
        for name in ("enable_prefix_cache", "use_graphs", "async_scheduling"):
            value = getattr(self, name)
            if not isinstance(value, bool) and (value is not None or name == "enable_prefix_cache"):
                raise ConfigError(f"{name} must be True or False, got {value!r:.40}")


# EngineConfig's integer fields, each with whether it may be None
_COUNT_FIELDS = {
    "block_size": False, "max_num_seqs": False, "max_num_batched_tokens": False,
    "max_model_len": True, "num_kv_blocks": True, "num_state_slots": True,
    "cpu_cache_bytes": False, "disk_cache_bytes": True, "host_cache_bytes": False,
    "checkpoint_interval": False,
}
