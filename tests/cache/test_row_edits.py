"""Index rows edited by hand to name the wrong data never give a wrong answer: a checkpoint row
naming another checkpoint's blob, or block rows whose `seg_index` (or `segment_id`) point at
another block's keys and values, are each a miss with one warning and the same tokens as no
cache, and so is a row naming no blob (NULL), rather than a TypeError; `statechat cache
verify` finds them too, and a row dropped for naming another row's blob leaves that blob to the
row it belongs to."""

from __future__ import annotations

import sqlite3

import pytest

from statechat.cache.store import open_store
from tests.cache import test_corruption as corruption
from tests.cache.test_corruption import damaged, rerun

model, warm_cache = corruption.model, corruption.warm_cache  # (its fixtures)


def edit(cache_dir, *statements: tuple[str, list]) -> None:
    db = sqlite3.connect(cache_dir / "index.db")
    with db:
        for sql, args in statements:
            db.execute(sql, args)
    db.close()


def point_192_at_128(cache_dir) -> str:
    """Make the 192-token checkpoint's row name the 128-token one's blob (and checksum)."""
    db = sqlite3.connect(cache_dir / "index.db")
    blob, crc = db.execute("SELECT blob, checksum FROM checkpoints "
                           "WHERE num_tokens = 128").fetchone()
    db.close()
    edit(cache_dir, ("UPDATE checkpoints SET blob = ?, checksum = ? WHERE num_tokens = 192",
                     [blob, crc]))
    return blob


def test_a_checkpoint_row_naming_another_checkpoint_s_blob_is_a_miss(model, warm_cache, caplog):
    blob = point_192_at_128(warm_cache)
    warning = damaged(model, warm_cache, caplog, "a checkpoint row naming another's blob")
    assert "another prefix" in warning
    assert (warm_cache / "blobs" / blob).exists()  # (the 128-token row's own blob stays)


def test_swapped_block_rows_of_a_segment_are_a_miss(model, warm_cache, caplog):
    db = sqlite3.connect(warm_cache / "index.db")
    (sid,) = db.execute("SELECT segment_id FROM blocks GROUP BY segment_id "
                        "HAVING count(*) > 1").fetchone()
    db.close()
    edit(warm_cache, ("UPDATE blocks SET seg_index = 1 - seg_index WHERE segment_id = ?", [sid]))
    out, warnings = rerun(model, warm_cache, caplog)  # (the same tokens as no cache)
    assert out.num_cached_tokens == 0, "blocks read from the wrong rows of their segment"
    assert len(warnings) == 1 and "another prefix" in warnings[0], warnings


def test_a_block_row_pointing_at_another_segment_is_a_miss(model, warm_cache, caplog):
    db = sqlite3.connect(warm_cache / "index.db")
    one = db.execute("SELECT segment_id FROM blocks GROUP BY segment_id "
                     "HAVING count(*) = 1").fetchone()[0]
    db.close()
    # the 192-token chain's last block read from the first block of the first segment
    move = ("UPDATE blocks SET segment_id = (SELECT min(segment_id) FROM blocks), seg_index = 0 "
            "WHERE segment_id = ?")
    edit(warm_cache, (move, [one]))
    warning = damaged(model, warm_cache, caplog, "a block row naming another segment")
    assert "another prefix" in warning


def test_verify_finds_rows_naming_the_wrong_data(warm_cache):
    blob = point_192_at_128(warm_cache)
    store = open_store(warm_cache)
    try:
        report = store.verify()
    finally:
        store.close()
    assert report["removed"] == [blob] and report["ok"] == report["checked"] - 1
    assert (warm_cache / "blobs" / blob).exists()  # the 128-token row still names it
    db = sqlite3.connect(warm_cache / "index.db")
    assert db.execute("SELECT num_tokens FROM checkpoints").fetchall() == [(128,)]


@pytest.mark.parametrize("table", ["checkpoints", "segments"])
def test_a_row_naming_no_blob_is_a_miss(model, warm_cache, caplog, table):
    """The 192-token checkpoint's row, or the segment of its last block, names no blob."""
    where = ("num_tokens = 192" if table == "checkpoints" else
             "id = (SELECT max(segment_id) FROM blocks)")
    edit(warm_cache, (f"UPDATE {table} SET blob = NULL WHERE {where}", []))
    out, warnings = rerun(model, warm_cache, caplog)  # (not a TypeError)
    assert out.num_cached_tokens == 128, "the prefix before the edited row is still used"
    assert len(warnings) == 1 and "names no blob" in warnings[0], warnings
    db = sqlite3.connect(warm_cache / "index.db")  # (dropped: the next request is quiet)
    assert db.execute(f"SELECT count(*) FROM {table} WHERE blob IS NULL").fetchone() == (0,)


def test_verify_drops_rows_naming_no_blob(warm_cache):
    edit(warm_cache, ("UPDATE checkpoints SET blob = NULL WHERE num_tokens = 192", []))
    store = open_store(warm_cache)
    try:
        report = store.verify()
    finally:
        store.close()
    assert len(report["removed"]) == 1 and report["ok"] == report["checked"] - 1


def test_verify_keeps_the_checkpoints_of_a_segment_it_cannot_open(warm_cache, monkeypatch):
    """A segment blob that cannot be opened (permissions, an I/O error) is reported and kept,
    and so are the checkpoints whose chain runs through it: only damage makes them dangle."""
    import os

    db = sqlite3.connect(warm_cache / "index.db")
    (blob,) = db.execute("SELECT blob FROM segments ORDER BY id LIMIT 1").fetchone()
    before = db.execute("SELECT count(*) FROM checkpoints").fetchone()
    db.close()
    path, real_open = warm_cache / "blobs" / blob, os.open

    def refuse(p, *args, **kwargs):
        if str(p) == str(path):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    store = open_store(warm_cache)
    try:
        report = store.verify()
    finally:
        store.close()
    assert report["unreadable"] == [blob] and report["dangling"] == [], report
    db = sqlite3.connect(warm_cache / "index.db")
    assert db.execute("SELECT count(*) FROM checkpoints").fetchone() == before


def test_an_engine_starts_beside_a_large_checkpoint_row_naming_no_blob(model, warm_cache,
                                                                       caplog):
    """(A start times a read of a recent large checkpoint: such a row raised a TypeError.)"""
    edit(warm_cache, ("UPDATE checkpoints SET blob = NULL, bytes = ? WHERE num_tokens = 192",
                      [64 << 20]))
    out, warnings = rerun(model, warm_cache, caplog)
    assert out.num_cached_tokens == 128 and len(warnings) == 1, warnings


@pytest.mark.parametrize("change", [
    "fingerprint = 'ab' || substr(fingerprint, 3)", "shapes = NULL", "shapes = '{}'"])
def test_verify_keeps_a_model_s_blobs_when_its_row_was_edited(model, warm_cache, caplog, change):
    """A `models` row edited by hand (its fingerprint or shapes) no longer matches its blobs,
    which are sound: verify reports the row and keeps them (it deleted every blob of the
    model, as damaged), and an engine of the model resumes from them as before."""
    db = sqlite3.connect(warm_cache / "index.db")
    rows_before = db.execute("SELECT count(*) FROM checkpoints").fetchone()[0]
    files_before = sorted(p.name for p in (warm_cache / "blobs").rglob("*.safetensors"))
    db.close()
    edit(warm_cache, (f"UPDATE models SET {change}", []))
    store = open_store(warm_cache)
    try:
        report = store.verify()
    finally:
        store.close()
    assert report["removed"] == [] and report["dangling"] == [], report
    assert [m["id"] for m in report["mismatched_models"]] == [1], report
    assert report["mismatched_models"][0]["blobs"] == len(files_before)
    assert sorted(p.name for p in (warm_cache / "blobs").rglob("*.safetensors")) == files_before
    out, _ = rerun(model, warm_cache, caplog)
    assert out.num_cached_tokens > 0 and rows_before > 0
