"""A damaged cache never gives a wrong answer: a truncated blob, a flipped byte, a blob of
another model, a deleted blob and a row without a blob each give a miss, one warning line and
the same tokens as no cache."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3

import pytest
import torch

from statechat.cache.store import open_store
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model
from tests.helpers import make_tiny

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPT_LEN = 200  # checkpoints at 128 (interval) and 192 (prompt end)


@pytest.fixture(scope="module")
def model(tiny_dirs):
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    prompt = torch.randint(0, 300, (PROMPT_LEN,),
                           generator=torch.Generator().manual_seed(4)).tolist()
    plain = LLMEngine(EngineConfig(model=path, device="cpu", enable_prefix_cache=False),
                      loaded=loaded)
    return path, loaded, prompt, plain.generate([prompt], PARAMS)[0].token_ids


def engine(path, loaded, cache_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=cache_dir,
                                  checkpoint_interval=2, num_kv_blocks=64, num_state_slots=32),
                     loaded=loaded)


@pytest.fixture
def warm_cache(model, tmp_path):
    """A cache dir holding the prompt's checkpoints (written by a first engine)."""
    path, loaded, prompt, _ = model
    first = engine(path, loaded, tmp_path)
    first.generate([prompt], PARAMS)
    first.close()
    return tmp_path


def ckpt_blob(cache_dir, num_tokens: int):
    db = sqlite3.connect(cache_dir / "index.db")
    (blob,) = db.execute("SELECT blob FROM checkpoints WHERE num_tokens = ?",
                         [num_tokens]).fetchone()
    return cache_dir / "blobs" / blob


def rerun(model, cache_dir, caplog):
    """A fresh engine (empty device tier) on the damaged dir: tokens, reuse, warnings."""
    path, loaded, prompt, want = model
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        second = engine(path, loaded, cache_dir)
        out = second.generate([prompt], PARAMS)[0]
        second.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert out.token_ids == want
    return out, warnings


def test_intact_cache_is_used_from_disk(model, warm_cache, caplog):
    out, warnings = rerun(model, warm_cache, caplog)
    assert out.num_cached_tokens == 192 and out.reused_from == "disk" and warnings == []


def damaged(model, cache_dir, caplog, what: str):
    out, warnings = rerun(model, cache_dir, caplog)
    assert out.num_cached_tokens < 192, f"{what}: the damaged checkpoint was used"
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    return warnings[0]


def test_truncated_blob(model, warm_cache, caplog):
    blob = ckpt_blob(warm_cache, 192)
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])
    assert "unreadable" in damaged(model, warm_cache, caplog, "truncated")


def test_flipped_byte(model, warm_cache, caplog):
    blob = ckpt_blob(warm_cache, 192)
    data = bytearray(blob.read_bytes())
    data[-100] ^= 0x40
    blob.write_bytes(bytes(data))
    assert "checksum" in damaged(model, warm_cache, caplog, "flipped byte")


def spoil_metadata(blob, metadata) -> None:
    """Give `blob` a header that is sound JSON with `metadata` as its `__metadata__`."""
    data = bytearray(blob.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    data[8 : 8 + n] = text + b" " * (n - len(text))
    blob.write_bytes(bytes(data))


@pytest.mark.parametrize("metadata", ["oops", ["a", "list"], 7])
def test_a_header_whose_metadata_is_not_an_object(model, warm_cache, caplog, metadata):
    """A header that is sound JSON with metadata other than an object (garbage that happens to
    parse) raised AttributeError out of the lookup and out of `cache verify`: tracebacks. It is
    a damaged blob like any other: a miss and one line; verify drops it."""
    spoil_metadata(ckpt_blob(warm_cache, 192), metadata)
    assert "unreadable" in damaged(model, warm_cache, caplog, "metadata")
    blob = ckpt_blob(warm_cache, 128)
    spoil_metadata(blob, metadata)
    store = open_store(warm_cache)
    report = store.verify()
    store.close()
    assert report["removed"] == [blob.relative_to(warm_cache / "blobs").as_posix()], report


def test_flipped_byte_found_by_verify_is_dropped_in_its_own_words(warm_cache, caplog):
    """`cache verify` says what it did with a damaged blob; it recomputes nothing, so its
    warning does not say it recomputes (a lookup's does)."""
    blob = ckpt_blob(warm_cache, 192)
    data = bytearray(blob.read_bytes())
    data[-100] ^= 0x40
    blob.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        report = open_store(warm_cache).verify()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert report["removed"] == [blob.relative_to(warm_cache / "blobs").as_posix()]
    assert len(warnings) == 1 and "checksum" in warnings[0], warnings
    assert warnings[0].endswith("dropped it"), warnings


def test_blob_of_another_model(model, warm_cache, caplog, tmp_path_factory):
    prompt = model[2]
    other_path = make_tiny(tmp_path_factory.mktemp("other"), layout="qwen3_5_text",
                           dtype="float32", seed=5)
    other_dir = tmp_path_factory.mktemp("other_cache")
    other = engine(other_path, load_model(other_path, dtype=torch.float32), other_dir)
    other.generate([prompt], PARAMS)
    other.close()
    shutil.copyfile(ckpt_blob(other_dir, 192), ckpt_blob(warm_cache, 192))
    assert "another model" in damaged(model, warm_cache, caplog, "foreign blob")


def test_deleted_blob(model, warm_cache, caplog):
    ckpt_blob(warm_cache, 192).unlink()
    assert "missing" in damaged(model, warm_cache, caplog, "deleted")


def test_row_without_blob(model, warm_cache, caplog):
    db = sqlite3.connect(warm_cache / "index.db")
    with db:
        db.execute("UPDATE checkpoints SET blob = 'ckpt/00/never-written.safetensors' "
                   "WHERE num_tokens = 192")
    assert "missing" in damaged(model, warm_cache, caplog, "row without blob")
    assert open_store(warm_cache).verify()["removed"] == []  # the bad row is gone already


def test_a_blob_that_cannot_be_opened_is_kept(model, warm_cache, caplog, monkeypatch):
    """An error opening a blob (its permissions, an I/O error, no file handles left) says
    nothing of its contents: the request computes instead, and the entry and file stay."""
    blob = ckpt_blob(warm_cache, 192)
    real_open = os.open

    def refuse(path, *args, **kwargs):
        if str(path) == str(blob):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    warning = damaged(model, warm_cache, caplog, "unopenable")
    assert "cannot be opened (Permission denied); kept it" in warning
    assert blob.exists()
    report = open_store(warm_cache).verify()
    assert (report["removed"] == []
            and report["unreadable"] == [blob.relative_to(warm_cache / "blobs").as_posix()])
    monkeypatch.undo()
    assert rerun(model, warm_cache, caplog)[0].num_cached_tokens == 192  # readable again: used


def test_verify_and_gc_remove_only_files_named_as_blobs(warm_cache):
    """Orphans are the store's own file names with no row; a user's file is never touched."""
    old = 1_000_000_000  # (older than the orphans' grace period)
    blobs_dir = warm_cache / "blobs"
    notes = blobs_dir / "notes.md"
    notes.write_text("mine")
    orphan = blobs_dir / "kv" / f"{'ab' * 16}.safetensors"
    orphan.write_bytes(b"x")
    temp = blobs_dir / "kv" / f"{'cd' * 16}.safetensors.{'ef' * 16}.tmp"
    temp.write_bytes(b"x")
    for f in (notes, orphan, temp):
        os.utime(f, (old, old))
    store = open_store(warm_cache)
    assert store.verify()["orphans_freed"] == 2  # (bytes: one each)
    assert notes.read_text() == "mine" and not orphan.exists() and not temp.exists()
    assert store.gc() >= 0 and notes.exists()
    store.clear()
    assert notes.read_text() == "mine"
    assert sorted(p.relative_to(blobs_dir).as_posix() for p in blobs_dir.rglob("*")) == ["notes.md"]


def test_verify_passes_over_what_an_engine_evicts_while_it_reads(warm_cache, monkeypatch):
    """A live engine deletes a row, then its blob, between verify's list of rows and its read
    of the blob: no damage to report (the cache was sound), nothing removed."""
    from statechat.cache.store import verify as verify_module

    read, evicted = verify_module.read_blob, []

    def evict_first(path, *args, **kwargs):
        if not evicted:  # (another process's eviction: the row first, then the blob)
            db = sqlite3.connect(warm_cache / "index.db")
            rel = path.relative_to(warm_cache / "blobs").as_posix()
            with db:
                db.execute("DELETE FROM checkpoints WHERE blob = ?", [rel])
                db.execute("DELETE FROM blocks WHERE segment_id IN "
                           "(SELECT id FROM segments WHERE blob = ?)", [rel])
                db.execute("DELETE FROM segments WHERE blob = ?", [rel])
            db.close()
            path.unlink()
            evicted.append(rel)
        return read(path, *args, **kwargs)

    monkeypatch.setattr(verify_module, "read_blob", evict_first)
    store = open_store(warm_cache)
    report = store.verify()
    store.close()
    assert evicted and report["removed"] == [] and report["unreadable"] == []
    assert report["ok"] == report["checked"]


def test_verify_removes_the_checkpoints_a_damaged_segment_leaves_without_blocks(warm_cache):
    """A damaged segment takes with it the checkpoints standing on its blocks: no request could
    resume from them, yet they stayed, counted in the budget, after a verify that said the
    cache was sound. Each is named in the report; a read-only verify names them and keeps
    them."""
    db = sqlite3.connect(warm_cache / "index.db")
    (first,) = db.execute("SELECT s.blob FROM segments s JOIN blocks b ON b.segment_id = s.id "
                          "WHERE b.position = 0").fetchone()
    standing = sorted(r[0] for r in db.execute("SELECT blob FROM checkpoints"))
    db.close()
    segment = warm_cache / "blobs" / first
    data = bytearray(segment.read_bytes())
    data[-100] ^= 0x40
    segment.write_bytes(bytes(data))
    kept = open_store(warm_cache, read_only=True).verify(remove=False)
    assert kept["removed"] == [first] and sorted(kept["dangling"]) == standing
    report = open_store(warm_cache).verify()
    assert report["removed"] == [first] and sorted(report["dangling"]) == standing
    # (none of them counts as sound: it said "ok" of every checkpoint it then removed)
    for got in (kept, report):
        assert got["ok"] == got["checked"] - 1 - len(standing)
    assert not any((warm_cache / "blobs" / b).exists() for b in standing)
    db = sqlite3.connect(warm_cache / "index.db")
    assert db.execute("SELECT count(*) FROM checkpoints").fetchone() == (0,)
    db.close()
    assert open_store(warm_cache).verify()["dangling"] == []


@pytest.mark.parametrize("outside", ["absolute", "relative"])
def test_a_row_naming_a_file_outside_the_cache_never_deletes_it(model, warm_cache, tmp_path_factory,
                                                               caplog, outside):
    """index.db is a public schema that people edit with `sqlite3`, and it can be damaged: a
    row whose blob names a file outside blobs/ ("/home/me/notes.txt", "../../notes.txt") is a
    damaged entry, and `verify`, a lookup and an eviction drop the row; they deleted the file."""
    notes = tmp_path_factory.mktemp("home") / "notes.txt"
    notes.write_text("mine")
    name = str(notes) if outside == "absolute" else os.path.relpath(notes, warm_cache / "blobs")
    db = sqlite3.connect(warm_cache / "index.db")
    with db:
        db.execute("UPDATE checkpoints SET blob = ? WHERE num_tokens = 192", [name])
    db.close()
    out, _ = rerun(model, warm_cache, caplog)  # (a lookup meets the row)
    assert out.num_cached_tokens < 192 and notes.read_text() == "mine"
    db = sqlite3.connect(warm_cache / "index.db")
    with db:
        db.execute("UPDATE checkpoints SET blob = ?", [name])
    db.close()
    store = open_store(warm_cache)
    assert store.verify()["removed"] and notes.read_text() == "mine"
    with store.db_lock, store.db.conn:  # (and an eviction of such a row)
        store.db.execute("INSERT INTO checkpoints (hash, model_id, num_tokens, blob, bytes, "
                         "checksum, created, last_used, hits) VALUES ('ab', 1, 64, ?, 1, '', 0, "
                         "0, 0)", [name])
    store.evict_to(0)
    store.close()
    assert notes.read_text() == "mine"
