"""The disk budget's LRU sees a prefix reused from memory: each save marks the segments of the
chain it stands on as used. A conversation's first blocks (a shared system prompt's) are read
back from device memory on every turn, never from disk, so their rows kept the oldest
`last_used` and were the first a full disk evicted, under the chats still growing on them."""

from __future__ import annotations

import sqlite3
import time

import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def oldest_segment_first_block(cache_dir) -> tuple[str, ...]:
    """The first block hash of each segment, least recently used first."""
    db = sqlite3.connect(cache_dir / "index.db")
    rows = db.execute("SELECT (SELECT hash FROM blocks WHERE segment_id = s.id ORDER BY position "
                      "LIMIT 1) FROM segments s ORDER BY s.last_used, s.id").fetchall()
    db.close()
    return tuple(r[0] for r in rows)


def test_a_conversation_s_first_blocks_stay_recent_while_it_grows(tiny_dirs, tmp_path):
    path = tiny_dirs["qwen3_5_text"]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path),
                       loaded=load_model(path, dtype=torch.float32))
    gen = torch.Generator().manual_seed(8)
    chat = torch.randint(0, 300, (200,), generator=gen).tolist()
    other = torch.randint(0, 300, (200,), generator=gen).tolist()
    engine.generate([chat], PARAMS)
    engine.store.flush()
    first = oldest_segment_first_block(tmp_path)[0]  # (the chat's first block)
    time.sleep(0.05)
    engine.generate([other], PARAMS)  # another chat, saved after the first one
    engine.store.flush()
    time.sleep(0.05)
    grown = chat + torch.randint(0, 300, (150,), generator=gen).tolist()
    out = engine.generate([grown], PARAMS)[0]  # the first chat's next turn, from memory
    engine.store.flush()
    assert out.reused_from == "device"
    order = oldest_segment_first_block(tmp_path)
    engine.close()
    assert order[0] != first and first in order  # the other chat's is the LRU victim now
