"""The disk tier's byte total that /metrics shows (`StateStore.bytes_used`, kept without a query
of its own) is the blobs' bytes after a save's eviction, not before it: a cache held to its
budget never shows more bytes than the budget (it showed the total the eviction started from,
twice what was left)."""

from __future__ import annotations

import sqlite3

import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model


def indexed_bytes(cache_dir) -> int:
    db = sqlite3.connect(cache_dir / "index.db")
    total = db.execute("SELECT (SELECT coalesce(sum(bytes),0) FROM checkpoints) "
                       "+ (SELECT coalesce(sum(bytes),0) FROM segments)").fetchone()[0]
    db.close()
    return total


def test_the_byte_total_is_the_one_left_after_an_eviction(tiny_dirs, tmp_path):
    path = tiny_dirs["qwen3_5_text"]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path),
                       loaded=load_model(path, dtype=torch.float32))
    gen = torch.Generator().manual_seed(8)
    chats = [torch.randint(0, 300, (200,), generator=gen).tolist() for _ in range(2)]
    try:
        engine.generate(chats[:1], SamplingParams(max_tokens=4, ignore_eos=True))
        engine.store.flush()
        one_chat = indexed_bytes(tmp_path)
        engine.store.budget = one_chat + one_chat // 4  # (room for one chat's blobs, not two)
        engine.generate(chats[1:], SamplingParams(max_tokens=4, ignore_eos=True))
        engine.store.flush()
        shown = engine.store.bytes_used
    finally:
        engine.close()
    assert shown == indexed_bytes(tmp_path) <= one_chat + one_chat // 4
