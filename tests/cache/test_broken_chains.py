"""A checkpoint is indexed only with every block of its chain on disk, and what an engine took
to be on disk but is not gets saved again. A save that failed (a full disk), or rows deleted
under a running engine (`statechat cache clear`, the budget's eviction), left the engine
believing those blocks were on disk: every later checkpoint of the conversation was saved
without them, unusable, so after a restart the chat reused nothing. Now a later turn resumes
after a restart at its own checkpoint, with the tokens of an engine with no cache."""

from __future__ import annotations

import errno
import sqlite3

import pytest
import torch

from statechat.cache.store import open_store, writer
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_dirs):
    """(path, loaded model, three turns of a chat, each extending the one before)."""
    path = tiny_dirs["qwen3_5_text"]
    gen = torch.Generator().manual_seed(3)
    turn1 = torch.randint(0, 300, (200,), generator=gen).tolist()
    turn2 = turn1 + torch.randint(0, 300, (150,), generator=gen).tolist()
    turn3 = turn2 + torch.randint(0, 300, (30,), generator=gen).tolist()
    return path, load_model(path, dtype=torch.float32), (turn1, turn2, turn3)


def engine_on(model, cache_dir, **kwargs) -> LLMEngine:
    path, loaded, _ = model
    return LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=cache_dir, **kwargs),
                     loaded=loaded)


def broken_checkpoints(cache_dir) -> list[int]:
    """The boundaries of indexed checkpoints whose chain lacks a block (never resumable)."""
    db = sqlite3.connect(cache_dir / "index.db")
    found = db.execute(
        "WITH RECURSIVE up(ckpt, hash, n) AS (SELECT hash, hash, 1 FROM checkpoints "
        "UNION ALL SELECT up.ckpt, b.parent, up.n + 1 FROM up JOIN blocks b ON b.hash = up.hash) "
        "SELECT c.num_tokens FROM checkpoints c WHERE c.num_tokens / 64 + 1 != "
        "(SELECT max(n) FROM up WHERE up.ckpt = c.hash)").fetchall()
    db.close()
    return sorted(r[0] for r in found)


def resumes_after_restart(model, cache_dir) -> None:
    """A new engine on `cache_dir` resumes the third turn at the second turn's checkpoint,
    with the tokens of an engine with no cache."""
    path, loaded, (_, turn2, turn3) = model
    plain = LLMEngine(EngineConfig(model=path, device="cpu", enable_prefix_cache=False),
                      loaded=loaded)
    want = plain.generate([turn3], PARAMS)[0].token_ids
    assert broken_checkpoints(cache_dir) == []
    engine = engine_on(model, cache_dir)
    out = engine.generate([turn3], PARAMS)[0]
    engine.close()
    assert (out.token_ids, out.num_cached_tokens) == (want, len(turn2) // 64 * 64)


def test_a_save_lost_to_a_full_disk_is_made_good_by_the_next(model, tmp_path, monkeypatch):
    _, _, (turn1, turn2, _) = model
    real, full = writer.write_blob, [True]

    def write_blob(*args, **kwargs):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "write_blob", write_blob)
    engine = engine_on(model, tmp_path)
    engine.generate([turn1], PARAMS)
    engine.store.flush()
    full[0] = False  # (room again: the next turn's save must carry the first turn's blocks)
    engine.generate([turn2], PARAMS)
    engine.prefix.flush_deferred()
    engine.close()
    resumes_after_restart(model, tmp_path)


def test_a_cache_cleared_under_a_running_engine_is_saved_again(model, tmp_path):
    _, _, (turn1, turn2, _) = model
    engine = engine_on(model, tmp_path)
    engine.generate([turn1], PARAMS)
    engine.store.flush()
    other = open_store(tmp_path)  # `statechat cache clear` in another process
    assert other.clear() > 0
    other.close()
    engine.generate([turn2], PARAMS)
    engine.close()
    resumes_after_restart(model, tmp_path)


def test_a_chat_s_blocks_evicted_by_the_budget_are_saved_again(model, tmp_path):
    """Another chat's save evicts the first chat's rows (the budget holds one chat); the
    first chat's next turn, resumed from device memory, saves them again."""
    _, _, (turn1, turn2, _) = model
    probe = engine_on(model, tmp_path / "probe")
    probe.generate([turn2], PARAMS)
    probe.close()
    one_chat = open_store(tmp_path / "probe").total_bytes() * 5 // 4  # (saved in two parts)
    engine = engine_on(model, tmp_path / "cache", disk_cache_bytes=one_chat)
    engine.generate([turn1], PARAMS)
    engine.store.flush()
    other = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    engine.generate([other], PARAMS)  # its save evicts the first chat's rows
    engine.store.flush()
    out = engine.generate([turn2], PARAMS)[0]
    engine.prefix.flush_deferred()
    engine.close()
    assert out.reused_from == "device"
    resumes_after_restart(model, tmp_path / "cache")


def test_a_clear_between_a_save_s_blobs_and_its_rows_leaves_no_row_without_its_blob(
        model, tmp_path, monkeypatch):
    """`statechat cache clear` in another process, landing after an engine wrote a save's
    blobs and before it indexed them, deleted those blobs, and the engine then indexed rows
    naming them: the next turn took its first blocks to be on disk, and after a restart the
    chat resumed nothing. Now the clear's deletions and the save's rows do not interleave: the
    rows of a blob gone are not written, and the next turn saves those blocks again."""
    import threading
    from pathlib import Path

    _, _, (turn1, turn2, _) = model
    written, unlinking = threading.Event(), threading.Event()
    insert_rows = writer.StoreWriter._insert_rows

    def late_insert(self, *args, **kwargs):  # (the writer thread, its blobs in place)
        written.set()
        unlinking.wait(10)
        return insert_rows(self, *args, **kwargs)

    unlink = Path.unlink

    def slow_unlink(self, *args, **kwargs):  # (the clear's first deletion gives way)
        if threading.current_thread() is threading.main_thread() and not unlinking.is_set():
            unlinking.set()
            threading.Event().wait(0.5)
        return unlink(self, *args, **kwargs)

    monkeypatch.setattr(writer.StoreWriter, "_insert_rows", late_insert)
    engine = engine_on(model, tmp_path)
    engine.generate([turn1], PARAMS)
    assert written.wait(10)
    other = open_store(tmp_path)  # `statechat cache clear` in another process
    monkeypatch.setattr(Path, "unlink", slow_unlink)
    other.clear()
    unlinking.set()  # (a clear that deleted nothing, the save's blobs under way, ends too)
    monkeypatch.setattr(Path, "unlink", unlink)
    other.close()
    engine.store.flush()
    db = sqlite3.connect(tmp_path / "index.db")
    blobs = [r[0] for r in db.execute("SELECT blob FROM segments UNION SELECT blob FROM "
                                      "checkpoints")]
    db.close()
    assert [b for b in blobs if not (tmp_path / "blobs" / b).exists()] == []
    monkeypatch.setattr(writer.StoreWriter, "_insert_rows", insert_rows)
    engine.generate([turn2], PARAMS)
    engine.close()
    resumes_after_restart(model, tmp_path)
