"""A full disk under a running engine costs the saves, never a request, and says so in one line
that says what to do, not one line per checkpoint it could not save (a batch on a full disk
printed a hundred identical warnings through its progress bar): the failures after it are
counted, and the count is said once when the engine closes."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3

import pytest
import torch

from statechat.cache import index
from statechat.cache.store import open_store, writer
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.errors import ConfigError
from statechat.model.loader import load_model
from tests.helpers import small_tmpfs

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def test_a_full_disk_is_one_line_and_a_count(tiny_dirs, tmp_path, monkeypatch, caplog):
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 300, (150,), generator=gen).tolist() for _ in range(5)]
    plain = LLMEngine(EngineConfig(model=path, device="cpu", enable_prefix_cache=False),
                      loaded=loaded)
    want = [o.token_ids for o in plain.generate(prompts, PARAMS)]

    calls = []

    def write_blob(*args, **kwargs):  # (the first write of a save raises: one call a save)
        calls.append(args[0])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "write_blob", write_blob)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path), loaded=loaded)
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        outs = [engine.generate([p], PARAMS)[0] for p in prompts]  # a save each, all failing
        engine.close()
    assert [o.token_ids for o in outs] == want
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    first = ("statechat cache: could not persist a checkpoint ([Errno 28] No space left on "
             f"device); free some space on the disk of {tmp_path}, or pick another cache dir "
             "(further failures like it are counted, not shown)")
    count = (f"statechat cache: {len(calls) - 1} more checkpoints could not be persisted "
             "([Errno 28] No space left on device)")
    assert said == [first, count], said
    assert len(calls) >= len(prompts)


def test_a_file_too_large_says_what_to_do(tiny_dirs, tmp_path, monkeypatch, caplog):
    """A blob larger than a file may be (EFBIG: `ulimit -f`, RLIMIT_FSIZE, or a file system's
    largest file) is told with what to do, as a full disk is (it was the error alone)."""
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    prompt = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(9)).tolist()

    def write_blob(*args, **kwargs):  # (as os.pwrite fails past RLIMIT_FSIZE, SIGXFSZ ignored)
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(writer, "write_blob", write_blob)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path), loaded=loaded)
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        engine.generate([prompt], PARAMS)
        engine.close()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said[0] == ("statechat cache: could not persist a checkpoint ([Errno 27] File too "
                       "large); a blob is larger than a file may be there (the file size limit, "
                       "`ulimit -f`, or the file system's largest file): raise the limit, or "
                       "pick a cache dir on another file system (further failures like it are "
                       "counted, not shown)"), said


def test_a_cause_that_names_each_save_s_file_is_still_one_line(tiny_dirs, tmp_path,
                                                               monkeypatch, caplog):
    """A cache folder made read-only under a running engine (a disk remounted read-only after
    errors, say) fails each save at its own temporary file, and OSError names that file: the
    failures are one cause all the same, one line and a count (each save was a line of its
    own, each saying that further failures would be counted)."""
    import itertools

    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 300, (150,), generator=gen).tolist() for _ in range(4)]
    names = itertools.count()

    def write_blob(target, *args, **kwargs):  # (as os.open fails on a read-only folder)
        raise OSError(errno.EROFS, "Read-only file system", f"{target}.{next(names)}.tmp")

    monkeypatch.setattr(writer, "write_blob", write_blob)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path), loaded=loaded)
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        for p in prompts:
            engine.generate([p], PARAMS)
            engine.store.flush()
        engine.close()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 2, said
    assert said[0].startswith("statechat cache: could not persist a checkpoint ([Errno 30] "
                              "Read-only file system: ")
    assert said[1] == (f"statechat cache: {next(names) - 1} more checkpoints could not be "
                       "persisted ([Errno 30] Read-only file system)")



@pytest.mark.parametrize("where", ["_write_checkpoint", "_insert_segment"])
def test_a_save_that_fails_deletes_the_blobs_it_wrote(tiny_dirs, tmp_path, monkeypatch, where):
    """A disk that fills during a save after its first blob (the checkpoint's blob after the
    segment's, or SQLite's "database or disk is full" as it writes their rows) left the blobs
    already written on disk, named by no row: files that took the room a full disk lacks,
    outside the budget, until someone ran `statechat cache gc`."""
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    prompt = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(8)).tolist()

    def fail(*args, **kwargs):  # (as the disk fails the checkpoint's blob, or index.db's rows)
        if where == "_write_checkpoint":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(writer.StoreWriter, where, fail)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path), loaded=loaded)
    store = engine.store
    engine.generate([prompt], PARAMS)
    engine.close()
    assert store.errors > 0
    assert [p.name for p in (tmp_path / "blobs").rglob("*") if p.is_file()] == []
    db = sqlite3.connect(tmp_path / "index.db")
    assert db.execute("SELECT count(*) FROM segments").fetchone() == (0,)


def fill(folder) -> None:
    """Fill the file system of `folder` with a file `filler` in it, to its last byte."""
    with open(folder / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while f.write(b"\0" * 4096):
            pass


@pytest.fixture
def full_disk(tmp_path):
    """A folder on a small file system filled to the last byte (a tmpfs mounted for the test;
    skipped where this user may not mount one)."""
    with small_tmpfs(tmp_path / "full", "1M") as mnt:
        fill(mnt)
        yield mnt


@pytest.mark.parametrize("existing", [False, True])
def test_a_cache_on_a_full_disk_says_the_disk_is_full(full_disk, tmp_path, existing):
    """An index that cannot be opened on a full disk (SQLite: "database or disk is full", or
    "disk I/O error" as it makes its shared-memory file) said "check the folder's permissions":
    it now says the disk is full. The index already there is left as it was, and can be read
    (as on read-only media: SQLite cannot make its shared-memory file there either)."""
    cache = full_disk / "cache"
    if existing:  # (a cache made before the disk filled, its files closed)
        os.remove(full_disk / "filler")
        store = open_store(cache)
        index.model_id(store.db, "ab" * 32, "tiny", "/models/tiny", "float32", 64)
        store.close()
        fill(full_disk)
        before = (cache / "index.db").read_bytes()
    with pytest.raises(ConfigError) as error:
        open_store(cache)
    assert str(error.value).startswith(f"cannot open {cache / 'index.db'} (")
    assert str(error.value).endswith(
        f"its disk is full (0 B free): `statechat cache clear --cache-dir {cache}` frees the "
        "cache's space "
        "(the chats are kept), or free some space on it, or pick a cache dir on another disk"), \
        error.value
    if existing:  # (and `cache stats` and `ls` read it: they said the same, and exited)
        reader = open_store(cache, read_only=True)
        assert [m["name"] for m in reader.stats()["models"]] == ["tiny"]
        reader.close()
        assert (cache / "index.db").read_bytes() == before
