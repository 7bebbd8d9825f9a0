"""Closing a store closes its index: once an engine is closed, the cache dir holds only
index.db and blobs/ (the write-ahead log folded in, its -wal and -shm files gone) while the
process goes on, as after `run`, which ends with os._exit; every row is still there."""

from __future__ import annotations

import sqlite3

import torch

from statechat.cache.store import open_store
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model


def rows(cache_dir) -> tuple[int, int]:
    """(checkpoints, blocks) as another program (sqlite3) reads them from index.db."""
    conn = sqlite3.connect(cache_dir / "index.db")
    try:
        return tuple(conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                     for t in ("checkpoints", "blocks"))
    finally:
        conn.close()


def test_a_closed_engine_leaves_no_write_ahead_log(tiny_dirs, tmp_path):
    path = tiny_dirs["qwen3_5_text"]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path),
                       loaded=load_model(path, dtype=torch.float32))
    engine.generate([list(range(3, 203))], SamplingParams(max_tokens=70, ignore_eos=True))
    engine.store.flush()
    saved = engine.store.stats()
    engine.close()
    engine.close()  # (a second close does nothing)
    again = engine.generate([list(range(3, 203))], SamplingParams(max_tokens=2))[0]
    assert again.num_cached_tokens == 192  # (an engine used after its close: device memory)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blobs", "index.db"]
    assert saved["num_checkpoints"] >= 2
    assert rows(tmp_path) == (saved["num_checkpoints"], saved["num_blocks"])


def test_closing_beside_another_connection_keeps_its_rows(tmp_path):
    """Another connection on index.db (the chats, another process) keeps the log it reads;
    what the store wrote is in index.db and stays readable there."""
    store = open_store(tmp_path)
    other = sqlite3.connect(tmp_path / "index.db")
    other.execute("SELECT count(*) FROM models").fetchone()
    with store.db_lock:
        store.db.execute("INSERT INTO models (fingerprint, name) VALUES ('ab', 'probe')")
    store.close()
    assert other.execute("SELECT name FROM models").fetchall() == [("probe",)]
    other.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.db"]
    assert open_store(tmp_path, read_only=True).stats()["models"][0]["name"] == "probe"


def held_writes(tiny_dirs, tmp_path, monkeypatch, wait_s: float):
    """A disk-tier engine whose writer holds each job until the event returned with it is set
    (a slow disk; the job fails the test after `wait_s`)."""
    import threading

    path = tiny_dirs["qwen3_5_text"]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path),
                       loaded=load_model(path, dtype=torch.float32))
    release, write = threading.Event(), engine.store._write

    def held_write(job):
        assert release.wait(wait_s)
        write(job)

    monkeypatch.setattr(engine.store, "_write", held_write)
    return engine, release


def test_a_write_still_under_way_keeps_the_index_open_for_its_row(tiny_dirs, tmp_path,
                                                                  monkeypatch):
    """A close whose waits end before the writer's last job (a slow disk) leaves the index open:
    the job's row still lands (closing it under the writer lost the row and left its blob an
    orphan)."""
    from statechat.cache.store import writer

    engine, release = held_writes(tiny_dirs, tmp_path, monkeypatch, 30)
    store = engine.store
    monkeypatch.setattr(store, "flush", lambda timeout=60.0, stall_s=None: None)
    monkeypatch.setattr(writer, "WRITER_JOIN_S", 0.2)
    engine.generate([list(range(3, 203))], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.close()
    release.set()
    store.writer.join(30)
    assert rows(tmp_path)[0] >= 1


def test_a_stuck_writer_is_not_waited_out_before_the_store_s_own_close(tiny_dirs, tmp_path,
                                                                       monkeypatch):
    """An engine's close waits for the writer's last reports (a checkpoint to queue again) only
    while the writer gets on: one stuck on a job (a slow disk, another process's lock) is left
    to the store's own close, rather than waited out twice."""
    import time

    from statechat.engine import persist

    engine, release = held_writes(tiny_dirs, tmp_path, monkeypatch, 60)
    monkeypatch.setattr(persist, "RETRY_STALL_S", 0.2, raising=False)
    engine.generate([list(range(3, 203))], SamplingParams(max_tokens=4, ignore_eos=True))
    start = time.monotonic()
    engine.prefix.flush_deferred(timeout=30)
    waited = time.monotonic() - start
    release.set()
    engine.close()
    assert waited < 5, waited
    assert rows(tmp_path)[0] >= 1
