"""An index edited by hand, as its public schema invites (`sqlite3 index.db "UPDATE ..."`),
leaves the `cache` commands working: a NULL where the schema allows one (a checkpoint's hits,
a row's bytes or last_used) is no traceback, and a checkpoint whose model row was deleted is
still listed by `ls`, as `stats` counts it (until `verify` removes it); a model name that is not
UTF-8 reads with U+FFFD for its bad bytes."""

from __future__ import annotations

import json
import sqlite3

from typer.testing import CliRunner

from statechat import cli
from tests.cli.test_commands import warm_cache

runner = CliRunner()


def edit(cache, sql: str) -> None:
    with sqlite3.connect(cache / "index.db") as db:
        db.executescript(sql)


def cache_cmd(cache, *argv: str):
    return runner.invoke(cli.app, ["cache", *argv, "--cache-dir", str(cache)])


def test_ls_shows_rows_with_nulls(tmp_path, shared_engine):
    cache = warm_cache(tmp_path)
    edit(cache, "UPDATE checkpoints SET hits = NULL, last_used = NULL, bytes = NULL, "
                "created = NULL")
    count = json.loads(cache_cmd(cache, "stats", "--json").stdout)["num_checkpoints"]
    result = cache_cmd(cache, "ls")
    assert result.exit_code == 0, result.output
    assert len(result.stdout.splitlines()) == 1 + count  # (the header, then every checkpoint)
    assert cache_cmd(cache, "ls", "--json").exit_code == 0


def test_gc_passes_rows_whose_size_is_null(tmp_path, shared_engine):
    """(A NULL size among the rows to evict was a TypeError: it counts as 0 bytes now.)"""
    cache = warm_cache(tmp_path)
    edit(cache, "UPDATE segments SET bytes = NULL, last_used = NULL")  # (evicted first)
    result = cache_cmd(cache, "gc", "--max-bytes", "0")
    assert result.exit_code == 0, result.output
    stats = json.loads(cache_cmd(cache, "stats", "--json").stdout)
    assert (stats["num_checkpoints"], stats["bytes_total"]) == (0, 0)


def test_ls_lists_the_checkpoints_of_a_deleted_model_row(tmp_path, shared_engine):
    cache = warm_cache(tmp_path)
    edit(cache, "DELETE FROM models")
    count = json.loads(cache_cmd(cache, "stats", "--json").stdout)["num_checkpoints"]
    rows = json.loads(cache_cmd(cache, "ls", "--json").stdout)
    assert count > 0 and len(rows) == count and all(r["model"] is None for r in rows)
    assert cache_cmd(cache, "verify").exit_code == 1  # (they belong to no model: removed)
    assert json.loads(cache_cmd(cache, "ls", "--json").stdout) == []


def test_stats_gives_a_model_s_size_in_the_unit_of_the_total(tmp_path, shared_engine):
    """(Its model line said `mb=2.409`, decimal MB, under `bytes 2.3 MiB`: two sizes that
    seemed to disagree.)"""
    cache = warm_cache(tmp_path)
    lines = cache_cmd(cache, "stats").stdout.splitlines()
    total = next(line for line in lines if line.startswith("bytes")).split()[1:3]
    model = next(line for line in lines if line.startswith("model"))
    assert model.endswith(" ".join(total)) and "tiny-qwen3.5" in model


def test_a_model_name_that_is_not_utf8_is_read_with_replacements(tmp_path, shared_engine):
    """(`ls`, `stats` and `verify` failed to read the index, blaming the folder's permissions.)"""
    cache = warm_cache(tmp_path)
    edit(cache, "UPDATE models SET name = CAST(X'6DFF' AS TEXT)")
    rows = json.loads(cache_cmd(cache, "ls", "--json").stdout)
    assert rows and all(r["model"] == "m\ufffd" for r in rows)
    stats = cache_cmd(cache, "stats")
    assert stats.exit_code == 0 and "m\ufffd" in stats.stdout, stats.output
    assert cache_cmd(cache, "verify").exit_code == 0
