"""`statechat cache clear` and `gc` on a full disk: SQLite has no room for the index's journal,
so the index cannot be opened to write; the commands delete the blob files first, which makes
the room, then their rows, and the chats in the same index.db are kept. They said the disk was
full and deleted nothing, which left `rm -rf` of the cache dir, chats and all. `verify` and an
engine say which command frees the space."""

from __future__ import annotations

import json
import re
import sqlite3

import pytest
from typer.testing import CliRunner

from statechat import cli
from tests.cli.test_commands import warm_cache
from tests.helpers import small_tmpfs

pytest.importorskip("statechat.cache.store", reason="the persistent cache store is not in this "
                                                    "build")
runner = CliRunner()


def blob_bytes(cache) -> int:
    return sum(p.stat().st_size for p in (cache / "blobs").rglob("*.safetensors"))


def rows(cache) -> tuple[int, int, int]:
    db = sqlite3.connect(cache / "index.db")
    try:
        return tuple(db.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                     for t in ("checkpoints", "segments", "blocks"))
    finally:
        db.close()


@pytest.fixture
def cache(tmp_path, shared_engine):
    """A cache dir with blobs and a chat in its index.db."""
    return chatted(warm_cache(tmp_path))


def chatted(cache):
    """`cache` with a chat titled "kept" in its index.db."""
    from statechat.chat.tree import open_chats

    chats = open_chats(cache)
    chats.add(chats.create("kept").id, None, "user", "hello")
    chats.db.conn.close()
    return cache


def disk_full_while(monkeypatch, full) -> None:
    """The index's writable open fails as on a full disk (SQLite: "database or disk is full")
    while `full()` holds: the disk fills up to the cache's blobs."""
    from statechat.cache import index
    from statechat.cache.sqlite_files import open_error

    connect = index.connect

    def on_a_full_disk(path):
        if full():
            raise open_error(path, sqlite3.OperationalError("database or disk is full"))
        return connect(path)

    monkeypatch.setattr(index, "connect", on_a_full_disk)


def chats_of(cache) -> list[str]:
    from statechat.chat.tree import open_chats

    chats = open_chats(cache)
    try:
        return [c.title for c in chats.conversations()]
    finally:
        chats.db.conn.close()


@pytest.mark.parametrize("command", [["clear", "--yes"], ["gc", "--max-bytes", "0"]])
def test_a_cache_on_a_disk_filled_to_its_last_byte_is_freed(tmp_path, shared_engine, command):
    """On a real full disk (a small tmpfs, filled): SQLite could not open the index to write."""
    from tests.cache.test_full_disk import fill

    with small_tmpfs(tmp_path / "disk", "4M") as mnt:
        cache = chatted(warm_cache(mnt))
        fill(mnt)
        result = runner.invoke(cli.app, ["cache", *command, "--cache-dir", str(cache)])
        assert result.exit_code == 0, result.output
        assert blob_bytes(cache) == 0 and rows(cache) == (0, 0, 0)
        assert chats_of(cache) == ["kept"]


def test_clear_on_a_full_disk_deletes_the_blobs_then_their_rows(cache, monkeypatch):
    held = blob_bytes(cache)
    disk_full_while(monkeypatch, lambda: blob_bytes(cache) > 0)
    result = runner.invoke(cli.app, ["cache", "clear", "--yes", "--cache-dir", str(cache)])
    assert result.exit_code == 0, result.output
    assert blob_bytes(cache) == 0 and rows(cache) == (0, 0, 0)
    assert held >= 1024 and result.stdout == f"freed {held / 1024:,.1f} KiB\n"
    assert chats_of(cache) == ["kept"]


def test_gc_on_a_full_disk_evicts_the_blobs_then_their_rows(cache, monkeypatch):
    """gc frees what it evicts as clear does: the files of the least recently used rows, read
    from the index alone, then those rows; what it keeps is whole (`verify` finds nothing)."""
    held, (_, num_segments, num_blocks) = blob_bytes(cache), rows(cache)
    keep = held - 1  # (the chain's last checkpoint goes, its blocks stay)
    disk_full_while(monkeypatch, lambda: blob_bytes(cache) > keep)
    result = runner.invoke(cli.app, ["cache", "gc", "--max-bytes", str(keep),
                                     "--cache-dir", str(cache)])
    assert result.exit_code == 0, result.output
    left = blob_bytes(cache)
    assert 0 < left <= keep and rows(cache) == (0, num_segments, num_blocks) != (0, 0, 0)
    assert result.stdout == f"freed {(held - left) / 1024:,.1f} KiB\n"
    monkeypatch.undo()
    verify = runner.invoke(cli.app, ["cache", "verify", "--cache-dir", str(cache)])
    assert verify.exit_code == 0, verify.output  # (no row names a deleted blob, no orphan)
    assert chats_of(cache) == ["kept"]


@pytest.mark.parametrize("command, then", [(["clear", "--yes"], "clear --yes"),
                                           (["gc", "--max-bytes", "0"], "verify")])
def test_a_disk_still_full_says_what_to_run(cache, monkeypatch, capsys, command, then):
    """Deleting the blobs did not make room (the disk is full of other files): one line that
    says so and what to run once there is room; the chats are kept."""
    disk_full_while(monkeypatch, lambda: True)
    monkeypatch.setattr("sys.argv", ["statechat", "cache", *command, "--cache-dir", str(cache)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err, err
    assert err.startswith(f"statechat: the disk of {cache} is still full after deleting ")
    assert err.endswith(f"of cache blobs; free some space on it, then `statechat cache {then} "
                        f"--cache-dir {cache}` deletes the index rows left naming them (the "
                        "chats are kept)")
    assert blob_bytes(cache) == 0
    monkeypatch.undo()
    assert chats_of(cache) == ["kept"]


def test_verify_on_a_full_disk_says_which_command_frees_the_space(cache, monkeypatch, capsys):
    disk_full_while(monkeypatch, lambda: True)
    monkeypatch.setattr("sys.argv", ["statechat", "cache", "verify", "--cache-dir", str(cache)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    said = capsys.readouterr().err.strip()
    assert re.fullmatch(
        re.escape(f"statechat: cannot open {cache / 'index.db'} (database or disk is full); its "
                  "disk is full (") + r"[0-9,.]+ (B|KiB|MiB|GiB) free" + re.escape(
            f"): `statechat cache clear --cache-dir {cache}` frees the cache's space (the chats "
            "are kept), or free some space on it, or pick a cache dir on another disk"), said), said


def cut_short_checkpoint(cache) -> None:
    """Leave `cache`'s index.db as a checkpoint of its write-ahead log that a full disk cut
    short leaves it: the log kept, the file's first page (its page count, the schema's root)
    already the log's newest, the pages it points at not yet copied. Read with its log, the
    index is whole; read without it, SQLite finds it malformed."""
    import struct

    from statechat.cache import index

    index.connect(cache / "index.db").conn.close()
    db = sqlite3.connect(cache / "index.db", isolation_level=None)
    db.execute("PRAGMA wal_autocheckpoint = 0")
    with db:
        db.executemany("INSERT INTO models (fingerprint, name, path, dtype, block_size, created) "
                       "VALUES (?, ?, ?, 'float32', 64, 0)",
                       [(f"{i:064x}", f"m{i}", "/models" * 100) for i in range(300)])
    main, wal = (cache / "index.db").read_bytes(), (cache / "index.db-wal").read_bytes()
    db.close()  # (it folds the log into the file: the files are put back as they were)
    (cache / "index.db-shm").unlink(missing_ok=True)
    page = struct.unpack(">I", wal[8:12])[0]
    frames = {struct.unpack(">I", wal[o:o + 4])[0]: wal[o + 24:o + 24 + page]
              for o in range(32, len(wal) - 24 - page + 1, 24 + page)}
    (cache / "index.db").write_bytes(frames[1] + main[page:])
    (cache / "index.db-wal").write_bytes(wal)


def one_line_error(monkeypatch, capsys, *argv: str) -> str:
    """The one line `statechat ARGV` prints on stderr as it exits with status 2."""
    monkeypatch.setattr("sys.argv", ["statechat", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err, err
    return err


@pytest.mark.parametrize("command", ["stats", "ls"])
def test_an_index_read_on_a_full_disk_is_not_called_damaged(tmp_path, monkeypatch, capsys,
                                                             command):
    """On a full disk SQLite cannot make the index's shared-memory file, so the reports read
    index.db as immutable, without its write-ahead log; a checkpoint the full disk cut short
    then reads as "malformed", and the line said to `.recover` a sound index. It says the disk
    is full, and how much is free."""
    from tests.cache.test_full_disk import fill

    with small_tmpfs(tmp_path / "disk", "4M") as mnt:
        cache = mnt / "cache"
        cache.mkdir()
        cut_short_checkpoint(cache)
        fill(mnt)
        err = one_line_error(monkeypatch, capsys, "cache", command, "--cache-dir", str(cache))
        assert ".recover" not in err
        assert err.startswith(f"statechat: cannot open {cache / 'index.db'} (database disk image "
                              "is malformed, as read without its write-ahead log, which SQLite "
                              "has no room to read on a full disk: no sign of damage); its disk "
                              "is full (0 B free): `statechat cache clear --cache-dir "), err
        (mnt / "filler").unlink()  # (with room, the same files read whole)
        stats = runner.invoke(cli.app, ["cache", "stats", "--json", "--cache-dir", str(cache)])
        assert stats.exit_code == 0, stats.output
        assert len(json.loads(stats.stdout)["models"]) == 300


@pytest.mark.parametrize("command", ["stats", "verify"])
def test_a_damaged_index_read_whole_on_a_full_disk_is_not_called_sound(tmp_path, monkeypatch,
                                                                        capsys, command):
    """Read with its write-ahead log (stats' first try, verify's writable open), a damaged
    index.db is damaged, full disk or not: the line said it was read without its log and showed
    "no sign of damage", and sent the user to `cache clear`, for a file that is not a database
    at all."""
    from tests.cache.test_full_disk import fill

    with small_tmpfs(tmp_path / "disk", "1M") as mnt:
        cache = mnt / "cache"
        cache.mkdir()
        (cache / "index.db").write_bytes(b"notes of another program, not a database\n" * 100)
        fill(mnt)
        err = one_line_error(monkeypatch, capsys, "cache", command, "--cache-dir", str(cache))
        assert err.startswith(f"statechat: cannot open {cache / 'index.db'} (file is not a "
                              "database); `sqlite3 "), err
