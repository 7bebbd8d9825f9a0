"""Another process evicts a blob this one is about to read and saves the same data again (a
checkpoint under a new blob name, or a new segment that takes the evicted one's row id): the
read is a miss, and the row of the new save stays, its data usable by the next request. (The
failed read dropped whatever row now held the checkpoint's hash, or the segment's id.)"""

from __future__ import annotations

import shutil
import sqlite3

import pytest

from statechat.cache.store import reads
from tests.cache import test_corruption as corruption
from tests.cache.test_corruption import rerun

model, warm_cache = corruption.model, corruption.warm_cache  # (its fixtures)


def evict_and_resave(cache_dir, table: str, key: str, value, blob: str) -> str:
    """What another process does between this one's look-up and its read of `blob`: evicts
    the row, then the file, then saves the same data under a new name (a new row; a segment's
    takes the same id, as SQLite gives the highest id again once it is free). The new name."""
    blobs = cache_dir / "blobs"
    new = blob[:-len(".safetensors")][:-8] + "0" * 8 + ".safetensors"
    if table == "segments":
        new = "kv/" + "0" * 32 + ".safetensors"
    shutil.copyfile(blobs / blob, blobs / new)
    db = sqlite3.connect(cache_dir / "index.db")
    with db:
        cols = [r[1] for r in db.execute(f"PRAGMA table_info({table})")]
        row = dict(zip(cols, db.execute(f"SELECT * FROM {table} WHERE {key} = ?",
                                        [value]).fetchone()))
        kept = []
        if table == "segments":
            kept = db.execute("SELECT * FROM blocks WHERE segment_id = ?", [value]).fetchall()
            db.execute("DELETE FROM blocks WHERE segment_id = ?", [value])
            del row["id"]  # (SQLite picks it: the same one)
        db.execute(f"DELETE FROM {table} WHERE {key} = ?", [value])
        (blobs / blob).unlink()
        row["blob"] = new
        names = ",".join(row)
        db.execute(f"INSERT INTO {table} ({names}) VALUES ({','.join('?' * len(row))})",
                   list(row.values()))
        if table == "segments":
            db.executemany(f"INSERT INTO blocks VALUES ({','.join('?' * len(kept[0]))})", kept)
            (sid,) = db.execute("SELECT id FROM segments WHERE blob = ?", [new]).fetchone()
            assert sid == value
    db.close()
    return new


@pytest.mark.parametrize("table", ["checkpoints", "segments"])
def test_a_read_that_misses_keeps_what_was_saved_again_meanwhile(model, warm_cache, caplog,
                                                                 monkeypatch, table):
    db = sqlite3.connect(warm_cache / "index.db")
    if table == "checkpoints":
        key, (value, blob) = "hash", db.execute(
            "SELECT hash, blob FROM checkpoints WHERE num_tokens = 192").fetchone()
    else:
        key, (value, blob) = "id", db.execute(
            "SELECT id, blob FROM segments ORDER BY id DESC LIMIT 1").fetchone()
    db.close()
    real, done = reads.read_blob, []

    def racing(path, *args, **kwargs):
        if not done and path.name == blob.rsplit("/", 1)[-1]:
            done.append(evict_and_resave(warm_cache, table, key, value, blob))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(reads, "read_blob", racing)
    rerun(model, warm_cache, caplog)  # (a miss: the same tokens as no cache)
    monkeypatch.undo()
    assert done
    db = sqlite3.connect(warm_cache / "index.db")
    assert db.execute(f"SELECT count(*) FROM {table} WHERE blob = ?", [done[0]]).fetchone() == (
        1,), "the other process's new row was dropped (its blob left an orphan)"
    db.close()
    assert rerun(model, warm_cache, caplog)[0].num_cached_tokens == 192
