"""The index's write-ahead log stays small beside a small disk budget: it grew by some 70 KB with
every save (SQLite folds it into index.db only past 1,000 pages, 4 MB, and never shrinks the
file), so a cache given 300 KB of a 3 MB disk filled the disk with its log while its blobs kept
to the budget. It is folded in once it passes a sixteenth of the budget now (from 4 MB down),
and cut back to that size; `cache stats` says what the index's files take."""

from __future__ import annotations

import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model

PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)
BUDGET = 300_000


def index_files(cache_dir) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in cache_dir.glob("index.db*")}


def test_the_write_ahead_log_does_not_grow_with_each_save(tiny_dirs, tmp_path):
    path = tiny_dirs["qwen3_5_text"]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path,
                                    disk_cache_bytes=BUDGET),
                       loaded=load_model(path, dtype=torch.float32))
    gen = torch.Generator().manual_seed(5)
    logs = []
    for _ in range(12):  # (a chat each: a save each, and an eviction)
        engine.generate([torch.randint(0, 300, (130,), generator=gen).tolist()], PARAMS)
        engine.store.flush()
        logs.append(index_files(tmp_path).get("index.db-wal", 0))
    stats = engine.store.stats()
    files = index_files(tmp_path)
    engine.close()
    assert max(logs[4:]) <= max(logs[:4]) < 150_000, logs  # (one save's pages, at most)
    assert stats["bytes_index"] == sum(files.values())
    assert stats["bytes_total"] <= BUDGET
