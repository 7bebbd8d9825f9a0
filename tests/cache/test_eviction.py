"""The disk budget's eviction leaves no entry that can never be used again: a KV segment goes
with every block after its own in a chain and the checkpoints at them (a prefix is resumed only
with every block of its chain), and with the segments that then hold no block. They used to
stay, counted against the budget, until their own turn in the LRU came."""

from __future__ import annotations

import sqlite3

import torch

from statechat.cache.store import open_store
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model


def counts(cache_dir) -> tuple[int, int, int, int]:
    db = sqlite3.connect(cache_dir / "index.db")
    row = tuple(db.execute("SELECT (SELECT count(*) FROM checkpoints), (SELECT count(*) FROM "
                           "segments), (SELECT count(*) FROM blocks), (SELECT count(*) FROM "
                           "checkpoints WHERE num_tokens = 64)").fetchone())
    db.close()
    return row


def test_evicting_the_first_segment_takes_what_depends_on_it(tiny_dirs, tmp_path):
    path = tiny_dirs["qwen3_5_text"]
    first = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path,
                                   checkpoint_interval=1, num_kv_blocks=64, num_state_slots=32),
                      loaded=load_model(path, dtype=torch.float32))
    prompt = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    first.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    first.close()
    num_ckpts, num_segments, num_blocks, _ = counts(tmp_path)
    assert num_ckpts == 3 and num_segments >= 2 and num_blocks == 3  # (64, 128, 192)
    db = sqlite3.connect(tmp_path / "index.db")
    with db:  # the segment holding the first block is the least recently used entry
        db.execute("UPDATE segments SET last_used = 0 WHERE id = "
                   "(SELECT segment_id FROM blocks WHERE position = 0)")
    db.close()
    store = open_store(tmp_path)
    total = store.total_bytes()
    freed = store.evict_to(total - 1)
    assert counts(tmp_path) == (0, 0, 0, 0) and freed == total
    assert store.total_bytes() == 0
    assert sorted(p.name for p in (tmp_path / "blobs").rglob("*.safetensors")) == []
    store.close()
