"""`cache stats` and `cache gc` follow the disk budget the engines use: the budget an engine
last wrote under (set with --disk-cache-bytes, or the default rule) is kept in the index's
`disk_budget` table. stats showed the default alone, so a user who ran with `20G` saw another
number, and a plain gc evicted a cache set to 20G down to the default (on a full disk, 10% of
what it held)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3

import pytest
from typer.testing import CliRunner

from statechat import cli
from tests.cli.test_commands import warm_cache

pytest.importorskip("statechat.cache.store", reason="the persistent cache store is not in this "
                                                    "build")
runner = CliRunner()


def batch(tmp_path, *flags: str):
    """A cache dir written by a batch of two long prompts, run with `flags`."""
    return warm_cache(tmp_path, *flags)


def stats(cache) -> dict:
    result = runner.invoke(cli.app, ["cache", "stats", "--json", "--cache-dir", str(cache)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def disk_full(monkeypatch) -> None:
    """The cache's disk as good as full: nothing free beside the cache's own blobs."""
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage._replace(free=0))


def test_stats_shows_the_budget_a_run_set(tmp_path, shared_engine, monkeypatch):
    cache = batch(tmp_path, "--disk-cache-bytes", "20G")
    disk_full(monkeypatch)  # (the default is then 10% of the cache's own: far from 20G)
    got = stats(cache)
    assert got["bytes_budget"] == 20 << 30
    assert got["bytes_budget_default"] == got["bytes_total"] // 10
    recorded = got["budget_recorded"]
    assert recorded["bytes"] == 20 << 30 and recorded["explicit"] is True
    assert recorded["pid"] == os.getpid() and recorded["set_at"] > 0
    text = runner.invoke(cli.app, ["cache", "stats", "--cache-dir", str(cache)]).stdout
    assert " of 20.0 GiB\n" in text
    assert "budget       20.0 GiB, set with --disk-cache-bytes by " in text
    db = sqlite3.connect(cache / "index.db")  # (people read it with sqlite3)
    assert db.execute("SELECT bytes, explicit, pid FROM disk_budget").fetchall() == [
        (20 << 30, 1, os.getpid())]
    db.close()


def test_gc_keeps_to_the_budget_a_run_set(tmp_path, shared_engine, monkeypatch):
    """A plain gc evicts down to the budget the last engine wrote under: one set with
    --disk-cache-bytes is kept (on a full disk too); a default one follows the default rule."""
    cache = batch(tmp_path, "--disk-cache-bytes", "20G")
    held = stats(cache)["bytes_total"]
    disk_full(monkeypatch)
    result = runner.invoke(cli.app, ["cache", "gc", "--cache-dir", str(cache)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("freed 0 B") and stats(cache)["bytes_total"] == held
    monkeypatch.undo()
    batch(tmp_path)  # (the same prompts, no flag: the default rule is recorded)
    assert stats(cache)["budget_recorded"]["explicit"] is False
    disk_full(monkeypatch)
    result = runner.invoke(cli.app, ["cache", "gc", "--cache-dir", str(cache)])
    assert result.exit_code == 0, result.output
    assert stats(cache)["bytes_total"] <= held // 10 < held


def test_an_index_made_before_the_budget_table_gets_it_with_an_engine_s_write(
        tmp_path, shared_engine):
    """An index made before `disk_budget` is read by the reports as it is, with no budget
    recorded, and an engine's first write adds the table, the index's rows kept."""
    cache = batch(tmp_path)
    held = stats(cache)
    db = sqlite3.connect(cache / "index.db")
    db.execute("DROP TABLE disk_budget")
    db.close()
    old = stats(cache)
    assert old["budget_recorded"] is None and old["bytes_total"] == held["bytes_total"] > 0
    assert old["bytes_budget"] == old["bytes_budget_default"]
    batch(tmp_path, "--disk-cache-bytes", "1G")
    new = stats(cache)
    assert new["budget_recorded"]["bytes"] == 1 << 30
    assert new["num_checkpoints"] == held["num_checkpoints"]
