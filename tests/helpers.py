"""Test helpers: tiny checkpoints and a single-sequence driver of our model."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import os
from pathlib import Path

import torch

from statechat.model.context import Context, ModelCaches

ROOT = Path(__file__).resolve().parents[1]


def subprocess_env() -> dict[str, str]:
    """The environment for a worker process: this checkout first on its path, then the caller's
    own PYTHONPATH (where a machine keeps packages outside site-packages)."""
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


BLOCK = 64


def make_tiny(out: Path, **kwargs) -> Path:
    """scripts/make_tiny_model.py's make_tiny_model, imported from the script file."""
    spec = importlib.util.spec_from_file_location("make_tiny_model",
                                                  ROOT / "scripts" / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_tiny_model(out, **kwargs)


class OneSequence:
    """Drives our model over one sequence: prefill chunks and decode steps, state carried.

    Uses GDN slot 1 and KV blocks 0.. in order, exactly as the engine would for one request.
    """

    def __init__(self, loaded, max_tokens: int = 1024) -> None:
        self.model, self.config = loaded.model, loaded.config
        num_blocks = (max_tokens + BLOCK - 1) // BLOCK
        self.caches = ModelCaches.allocate(self.config, 2, num_blocks, BLOCK, loaded.dtype,
                                           loaded.device)
        self.device = loaded.device
        self.block_table = torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None]
        self.num_tokens = 0

    def step(self, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Feed `ids`; return logits of every token (all_logits) or of the last one."""
        n, start, dev = len(ids), self.num_tokens, self.device
        positions = torch.arange(start, start + n, device=dev)
        ctx = Context(
            positions=positions,
            cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=dev),
            is_decode=n == 1 and start > 0,
            state_src=torch.tensor([1 if start > 0 else 0], dtype=torch.int32, device=dev),
            state_dst=torch.tensor([1], dtype=torch.int32, device=dev),
            slot_mapping=positions.clone(),
            block_tables=self.block_table,
            context_lens=torch.tensor([start + n], dtype=torch.int32, device=dev),
            logits_indices=None if all_logits else torch.tensor([n - 1], device=dev),
        )
        self.num_tokens += n
        return self.model(torch.tensor(ids, device=dev), ctx, self.caches).cpu()


class PolicyModel:
    """Where checkpoints should exist after each request, computed from the policy alone."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.points: list[tuple[list[int], int]] = []  # (token ids, boundary)

    def record(self, prompt: list[int], output: list[int]) -> None:
        tokens = prompt + output
        self.points.append((tokens, (len(prompt) - 1) // BLOCK * BLOCK))
        fed = len(tokens) - 1  # the last sampled token is never fed back
        for b in range(BLOCK, fed + 1, BLOCK):
            if b % (self.interval * BLOCK) == 0:
                self.points.append((tokens, b))
        reply_end = fed // BLOCK * BLOCK
        if reply_end >= len(prompt):
            self.points.append((tokens, reply_end))

    def expected_reuse(self, prompt: list[int]) -> int:
        best = 0
        for tokens, b in self.points:
            if 0 < b < len(prompt) and tokens[:b] == prompt[:b]:
                best = max(best, b)
        return best


def engine_config(device: str) -> dict[str, object]:
    """EngineConfig fields for a module's tiny engine on `device`: on a GPU a small share of
    its memory, so the engine tests that follow size their caches as usual."""
    return {"device": device, "memory_fraction": 0.05} if device != "cpu" else {"device": device}


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str):
    """`folder` (made) with a tmpfs of `size` (`1M`) mounted on it while the block runs; the
    test skipped where this user may not mount one (then only the tests that stand in a full
    disk by patching run)."""
    import subprocess

    import pytest

    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                      capture_output=True, check=False).returncode:
        pytest.skip("cannot mount a small file system here")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def cpu_engine(loaded, **fields):
    """An LLMEngine on the CPU over `loaded` (a LoadedModel), with these EngineConfig fields."""
    from statechat.config import EngineConfig
    from statechat.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=loaded.path, device="cpu", **fields), loaded=loaded)


def random_prompts(*lengths: int, seed: int = 3) -> list[list[int]]:
    """Prompts of these lengths of ids in [3, 300), the same for a seed."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in lengths]


# Qwen3.5's shape, in brief: an earlier reply's reasoning dropped, a generation prompt that
# opens <think> (or, with enable_thinking false, closes an empty one at once)
THINKING = (
    "{%- for m in messages %}{%- set c = m['content'] | trim %}"
    "{%- if m['role'] == 'assistant' and '</think>' in c %}"
    "{%- set c = c.split('</think>')[-1] | trim %}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def with_template(loaded, template: str):
    """`loaded` (a LoadedModel) with its tokenizer rendering chats by `template`."""
    tokenizer = copy.copy(loaded.tokenizer)
    tokenizer.chat_template = template
    return dataclasses.replace(loaded, tokenizer=tokenizer)


def force_reply(engine, monkeypatch, text: str, ids: list[int] | None = None) -> list[int]:
    """Have every reply of `engine` be `text` then the end of turn, whatever the model samples:
    its scheduler is handed those tokens in place of the sampled ones (the host's record of
    each sequence; the device goes on from what it sampled, and a reply's cache entries with
    it, so use a fresh engine). `text` is spelt a character at a time (the tiny tokenizer
    makes `</think>` a special token, which a reply's text leaves out; Qwen3.5's does not),
    unless `ids` gives the reply's tokens. The forced token ids."""
    tokenizer, scheduler = engine.tokenizer, engine.scheduler
    if ids is None:
        ids = [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]
    ids = list(ids)
    ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    postprocess = scheduler.postprocess

    def forcing(batch, tokens):
        sampled, given = iter(tokens), []
        for it in (it for it in batch.items if it.needs_logits):
            token, made = next(sampled), len(it.seq.output_ids)
            given.append(ids[made] if made < len(ids) and not it.seq.is_finished else token)
        return postprocess(batch, given)

    monkeypatch.setattr(scheduler, "postprocess", forcing)
    return ids


def assert_idle_pools(engine) -> None:
    """Assert that `engine` (an LLMEngine) holds what an idle engine may hold and no more: no
    request queued, running or queued ahead; every KV block unreferenced, and free or (cached
    under its hash) evictable, each once; every GDN state slot but the null one free or a
    published, unpinned checkpoint on the LRU list, each once; no checkpoint published but not
    taken for the disk tier; the runner keeping no request's generator or penalty row."""
    sched, prefix = engine.scheduler, engine.prefix
    assert not sched.waiting and not sched.running, "requests left in the scheduler"
    assert not sched.new_checkpoints, "checkpoints published but never taken"
    assert engine._ahead is None, "a step queued ahead"
    blocks, slots = sched.blocks, sched.slots
    assert prefix.blocks is blocks and prefix.slots is slots
    held = {b: r for b, r in enumerate(blocks.ref_count) if r}
    assert not held, f"KV blocks still referenced: {held}"
    free, evictable = list(blocks.free), list(blocks.evictable)
    assert len(set(free)) == len(free), "a KV block free twice"
    assert not set(free) & set(evictable), "a KV block both free and evictable"
    assert sorted(free + evictable) == list(range(blocks.num_blocks)), "KV blocks lost"
    assert all(blocks.hash_of[b] is None for b in free), "a free KV block keeps a hash"
    assert blocks.by_hash == {blocks.hash_of[b]: b for b in evictable}, "block hashes differ"
    ckpts = slots.checkpoints
    assert all(c.refs == 0 for c in ckpts.values()), "a checkpoint still pinned"
    assert set(slots.lru) == set(ckpts), "the checkpoints' LRU list differs from them"
    assert slots.hash_of_slot == {c.slot: h for h, c in ckpts.items()}, "slot hashes differ"
    sfree = list(slots.free)
    assert len(set(sfree)) == len(sfree), "a state slot free twice"
    assert 0 not in sfree, "the null slot handed out"
    assert sorted(sfree + [c.slot for c in ckpts.values()]) == list(range(1, slots.num_slots)), (
        "state slots lost")
    runner = engine.runner
    assert not runner.generators, "per-request generators kept"
    assert runner.counts is None or not runner.counts.rows, "penalty rows kept"
