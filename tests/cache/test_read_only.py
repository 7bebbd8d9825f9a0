"""A store opened to report (`open_store(..., read_only=True)`) creates and changes nothing:
no cache dir, no index.db, no row; its `verify(remove=False)` lists damaged entries and orphan
blobs and keeps them, where `verify()` removes them and lists what it removed."""

from __future__ import annotations

import os

from statechat.cache.store import open_store

OLD = 1_000_000_000  # a file time older than the orphans' grace period


def orphans(cache_dir, n: int) -> list[str]:
    """n blob files named as the store names its own, that no row points at."""
    names = [f"kv/{i:032x}.safetensors" for i in range(n)]
    for name in names:
        path = cache_dir / "blobs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 10)
        os.utime(path, (OLD, OLD))
    return names


def test_a_read_only_store_makes_nothing(tmp_path):
    missing = tmp_path / "not-yet" / "cache"
    store = open_store(missing, read_only=True)
    assert store.stats()["num_checkpoints"] == 0 and store.ls() == [] and store.budget > 0
    assert not missing.exists() and not missing.parent.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    names = orphans(empty, 2)
    report = open_store(empty, read_only=True).verify(remove=False)
    assert report["orphans"] == names and report["orphans_freed"] == 0
    assert sorted(p.name for p in empty.iterdir()) == ["blobs"]  # (no index.db)
    assert all((empty / "blobs" / name).exists() for name in names)


def test_verify_lists_the_orphans_it_removes(tmp_path):
    store = open_store(tmp_path)
    names = orphans(tmp_path, 3)
    (tmp_path / "blobs" / "kv" / "notes.txt").write_text("mine")
    report = store.verify()
    assert report["orphans"] == names and report["orphans_freed"] == 30
    assert [p.name for p in (tmp_path / "blobs" / "kv").iterdir()] == ["notes.txt"]


def test_an_empty_index_file_reads_as_an_empty_index(tmp_path):
    (tmp_path / "index.db").write_bytes(b"")
    store = open_store(tmp_path, read_only=True)
    assert store.stats()["num_blocks"] == 0
    assert (tmp_path / "index.db").read_bytes() == b""
