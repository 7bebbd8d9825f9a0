"""An index that fails under a running engine (a damaged index.db, a disk I/O error) costs the
disk tier, never a request: the lookup or save that met it counts as no disk hit, one warning
names the cache dir and the error, and the engine goes on from device memory with the disk tier
off for the rest of the process (it raised out of the engine step, and with it out of the
server or the app). A lock another process holds past the busy timeout costs only the save or
lookup that met it: the disk tier stays on."""

from __future__ import annotations

import logging
import sqlite3
from concurrent.futures import Future

import pytest
import torch

from statechat.cache import index
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_dirs):
    """(path, loaded model, two prompts, each one's tokens with no cache)."""
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (200, 300)]
    plain = LLMEngine(
        EngineConfig(model=path, device="cpu", enable_prefix_cache=False), loaded=loaded
    )
    return path, loaded, prompts, [o.token_ids for o in plain.generate(prompts, PARAMS)]


def cached_engine(model, cache_dir) -> LLMEngine:
    path, loaded, _, _ = model
    return LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=cache_dir), loaded=loaded)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def damage_index(engine: LLMEngine) -> bytes:
    """Overwrite every page of index.db but the first under the running engine (its write-ahead
    log folded in first, and its page cache let go, so that its next query reads the disk);
    the damaged file's bytes."""
    store = engine.store
    with store.db_lock:
        store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        store.db.execute("PRAGMA shrink_memory")
    path = store.path / "index.db"
    raw = bytearray(path.read_bytes())
    raw[4096:] = b"\xa5" * (len(raw) - 4096)
    path.write_bytes(bytes(raw))
    return bytes(raw)


def test_a_damaged_index_under_a_running_engine_turns_the_disk_tier_off(model, tmp_path, caplog):
    _, _, (first, second), want = model
    engine = cached_engine(model, tmp_path)
    engine.generate([first], PARAMS)
    engine.store.flush()
    damaged = damage_index(engine)
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        outs = engine.generate([second, first], PARAMS)  # (it raised: disk image malformed)
        once = warnings_of(caplog)
        again = engine.generate([first, second], PARAMS)
        engine.close()
    assert [o.token_ids for o in outs + again] == want[::-1] + want
    assert outs[1].reused_from == again[0].reused_from == "device"  # (device memory goes on)
    assert len(once) == 1 and str(tmp_path) in once[0] and "malformed" in once[0], once
    assert warnings_of(caplog) == once  # the tier is off: no lookup fails again
    assert (tmp_path / "index.db").read_bytes() == damaged  # left for the user to look at


def test_an_index_error_while_saving_turns_the_disk_tier_off(model, tmp_path, caplog, monkeypatch):
    _, _, (first, second), want = model
    engine = cached_engine(model, tmp_path)
    calls = []

    def failing_touch(*args):
        calls.append(args)
        error = sqlite3.OperationalError("disk I/O error")
        error.sqlite_errorcode = sqlite3.SQLITE_IOERR_WRITE  # (an extended code, as SQLite's)
        raise error

    monkeypatch.setattr(index, "touch_chain", failing_touch)
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        out = engine.generate([first], PARAMS)[0]  # its saves fail in the writer thread
        engine.store.flush()
        later = engine.generate([second, first], PARAMS)
        engine.store.flush()
        engine.close()
    assert [o.token_ids for o in [out, *later]] == [want[0], *want[::-1]]
    assert later[1].reused_from == "device"
    said = warnings_of(caplog)
    assert len(said) == 1 and str(tmp_path) in said[0] and "disk I/O error" in said[0], said
    assert len(calls) == 1  # nothing was written after the first failure
    assert engine.prefix.store is None


def test_an_index_error_in_a_lookup_is_no_disk_hit(model, tmp_path, caplog, monkeypatch):
    """The lookup that met the error plans from device memory alone (not a request lost)."""
    _, _, (first, _), want = model
    engine = cached_engine(model, tmp_path)
    engine.generate([first], PARAMS)
    engine.store.flush()

    def failing(*args):
        raise sqlite3.DatabaseError("database disk image is malformed")

    monkeypatch.setattr(index, "checkpoints_present", failing)
    monkeypatch.setattr(index, "blocks_present", failing)
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        out = engine.generate([first], PARAMS)[0]
        engine.close()
    assert out.token_ids == want[0] and out.reused_from == "device"
    assert out.num_cached_tokens == 192
    assert len(warnings_of(caplog)) == 1


def locked(*args):
    error = sqlite3.OperationalError("database is locked")
    error.sqlite_errorcode = sqlite3.SQLITE_BUSY
    raise error


def num_checkpoints(cache_dir) -> int:
    db = sqlite3.connect(cache_dir / "index.db")
    try:
        return db.execute("SELECT count(*) FROM checkpoints").fetchone()[0]
    finally:
        db.close()


def test_a_lock_held_elsewhere_costs_a_save_not_the_disk_tier(model, tmp_path, caplog):
    """Another connection inside BEGIN IMMEDIATE (a user's `sqlite3 index.db`) past the busy
    timeout: the save that met it is lost, and once the lock goes saves land again."""
    _, _, (first, second), want = model
    engine = cached_engine(model, tmp_path)
    store = engine.store
    with store.db_lock:
        store.db.execute("PRAGMA busy_timeout = 200")  # (not SQLite's 30 s)
    other = sqlite3.connect(tmp_path / "index.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        out = engine.generate([first], PARAMS)[0]
        store.flush()
        assert store.errors >= 1 and num_checkpoints(tmp_path) == 0
        other.execute("ROLLBACK")
        other.close()
        again = engine.generate([second], PARAMS)[0]
        store.flush()
    assert [out.token_ids, again.token_ids] == want
    assert store.failed is None and engine.prefix.store is store
    assert num_checkpoints(tmp_path) >= 1  # written again
    assert not any("disk cache is off" in m for m in warnings_of(caplog))
    engine.close()


def test_a_locked_index_in_a_lookup_is_a_miss_for_that_request(model, tmp_path, monkeypatch):
    _, _, (first, _), want = model
    engine = cached_engine(model, tmp_path)
    engine.generate([first], PARAMS)
    engine.store.flush()
    with monkeypatch.context() as patch:
        patch.setattr(index, "checkpoints_present", locked)
        patch.setattr(index, "blocks_present", locked)
        out = engine.generate([first], PARAMS)[0]
    assert out.token_ids == want[0] and out.reused_from == "device"
    assert engine.store.failed is None and engine.prefix.store is engine.store
    engine.store.flush()
    engine.close()


def test_a_cancelled_check_of_the_disk_is_passed_over(model, tmp_path):
    _, _, (first, _), want = model
    engine = cached_engine(model, tmp_path)
    check = Future()
    check.cancel()
    engine.prefix.disk_checks.append(check)
    out = engine.generate([first], PARAMS)[0]  # (it raised CancelledError)
    assert out.token_ids == want[0] and engine.prefix.store is engine.store
    engine.close()


def test_a_lock_held_elsewhere_neither_stops_a_start_nor_a_disk_hit(model, tmp_path, monkeypatch):
    """A user's `sqlite3 index.db` inside BEGIN IMMEDIATE, past SQLite's wait: an engine on a
    model the index knows starts (it used to write the model's shapes at every start, and
    refused to start), and resumes from disk (each disk read of a checkpoint counted its hit
    at once, and waited the lock out: the request stalled, then lost its hit). The hit is
    counted once the lock goes."""
    _, _, (first, _), want = model
    engine = cached_engine(model, tmp_path)
    engine.generate([first], PARAMS)
    engine.close()
    monkeypatch.setattr(index, "BUSY_TIMEOUT_S", 0.2)  # (not SQLite's 30 s)
    other = sqlite3.connect(tmp_path / "index.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    engine = cached_engine(model, tmp_path)
    out = engine.generate([first], PARAMS)[0]
    other.execute("ROLLBACK")
    engine.store.flush()
    engine.close()
    assert (out.token_ids, out.reused_from, out.num_cached_tokens) == (want[0], "disk", 192)
    assert other.execute("SELECT hits FROM checkpoints WHERE num_tokens = 192").fetchall() == [(1,)]
    other.close()


def test_a_lock_held_elsewhere_at_a_new_model_s_start_costs_the_disk_tier_not_the_start(
        model, tmp_path, monkeypatch, caplog):
    """A model the index does not know needs its row written at start: with a user's `sqlite3
    index.db` inside BEGIN IMMEDIATE past SQLite's wait, the engine starts with its disk tier
    off and says so once (it refused to start, "locked by another process"), and serves from
    memory; once the lock goes, the next start adds the model and saves."""
    _, _, (first, _), want = model
    from statechat.cache.store import open_store

    open_store(tmp_path).close()  # (an index that knows no model yet)
    monkeypatch.setattr(index, "BUSY_TIMEOUT_S", 0.2)  # (not SQLite's 30 s)
    other = sqlite3.connect(tmp_path / "index.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        engine = cached_engine(model, tmp_path)
        out = engine.generate([first], PARAMS)[0]
        engine.close()
    other.execute("ROLLBACK")
    other.close()
    assert out.token_ids == want[0] and engine.prefix.store is None
    said = (f"statechat cache: {tmp_path / 'index.db'} is locked by another process (a "
            "`sqlite3` shell inside a transaction?), so this model's entry could not be written; "
            "the disk cache is off until statechat restarts (requests go on from memory)")
    assert [m for m in warnings_of(caplog) if "locked" in m] == [said]
    assert num_checkpoints(tmp_path) == 0
    engine = cached_engine(model, tmp_path)
    engine.generate([first], PARAMS)
    engine.close()
    assert num_checkpoints(tmp_path) >= 1
