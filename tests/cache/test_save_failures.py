"""A save lost to a lock another process held past SQLite's wait (a `sqlite3 index.db` shell
inside `BEGIN`) is told with its cause and what becomes of the cache, as a full disk's is: it
was `could not persist a checkpoint (database is locked)` alone, which named neither the
index nor the other process."""

from __future__ import annotations

import logging
import sqlite3

from statechat.cache.store.failures import FailedSaves


def locked_error(path) -> sqlite3.OperationalError:
    """The error SQLite gives a writer while another connection holds the write lock."""
    holder = sqlite3.connect(path / "index.db", isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    writer = sqlite3.connect(path / "index.db", timeout=0)
    try:
        writer.execute("INSERT INTO t VALUES (1)")
    except sqlite3.OperationalError as e:
        return e
    finally:
        writer.close()
        holder.close()
    raise AssertionError("the write went through a held lock")


def test_a_save_lost_to_a_lock_says_who_holds_it_and_that_the_cache_goes_on(tmp_path, caplog):
    failures = FailedSaves(tmp_path)
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        failures.failed(locked_error(tmp_path))
    [said] = [r.getMessage() for r in caplog.records]
    assert said.startswith("statechat cache: could not persist a checkpoint (database is "
                           f"locked); another process held {tmp_path / 'index.db'} locked")
    assert "sqlite3" in said and "\n" not in said
