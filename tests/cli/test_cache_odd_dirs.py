"""The `cache` commands on odd cache dirs: a file in the cache dir's place or above it is the
same one line from every one of them (`cache path` printed it as the cache dir, and the others
under a file said `no cache at ... yet`, where none can ever be); `stats --json` of a cache dir
not made yet gives the budget an engine would start it with; `stats` and `ls` refuse another
program's SQLite file as the others do, and read an index that lost its schema version."""

from __future__ import annotations

import pytest

from statechat import cli

COMMANDS = [["path"], ["stats"], ["stats", "--json"], ["ls"], ["verify"], ["gc"],
            ["clear", "--yes"]]


def run_cli(monkeypatch, capsys, argv: list[str]) -> tuple[int, str, str]:
    """`statechat ARGV`'s exit status, stdout and stderr."""
    monkeypatch.setattr("sys.argv", ["statechat", *argv])
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv", COMMANDS)
def test_a_file_in_place_of_the_cache_dir_is_one_line(tmp_path, monkeypatch, capsys, argv):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a folder\n")
    for cache_dir in (blocker, blocker / "cache"):
        code, out, err = run_cli(monkeypatch, capsys,
                                 ["cache", *argv, "--cache-dir", str(cache_dir)])
        assert (code, out) == (2, "")
        assert err == f"statechat: {blocker} is a file; pass a folder as --cache-dir\n"
    assert blocker.read_text() == "not a folder\n"


def test_stats_json_of_a_missing_cache_dir_gives_the_budget_an_engine_would_start_with(
        tmp_path, monkeypatch, capsys):
    """(Its budget was null, where an empty cache dir's is the default rule's.)"""
    import json

    empty = tmp_path / "empty"
    empty.mkdir()
    figures = {}
    for name in ("empty", "missing"):
        code, out, _ = run_cli(monkeypatch, capsys, ["cache", "stats", "--json", "--cache-dir",
                                                     str(tmp_path / name)])
        assert code == 0
        figures[name] = json.loads(out)
    assert not (tmp_path / "missing").exists()
    for stats in figures.values():
        assert stats["bytes_budget"] == stats["bytes_budget_default"] > 0
        assert stats["budget_recorded"] is None
    # (the same disk: the same 10% of its free space, within what others wrote meanwhile)
    assert figures["missing"]["bytes_budget"] == pytest.approx(
        figures["empty"]["bytes_budget"], rel=0.01)


def test_another_program_s_sqlite_file_is_one_line_from_stats_and_ls_too(tmp_path, monkeypatch,
                                                                         capsys):
    """(`stats` and `ls` read it as an empty cache, where `verify`, `gc`, `clear` and an engine
    refuse it.) The file is left as it was."""
    import sqlite3

    cache = tmp_path / "cache"
    cache.mkdir()
    with sqlite3.connect(cache / "index.db") as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
    before = (cache / "index.db").read_bytes()
    for argv in (["stats"], ["stats", "--json"], ["ls"], ["verify"]):
        code, out, err = run_cli(monkeypatch, capsys,
                                 ["cache", *argv, "--cache-dir", str(cache)])
        assert (code, out) == (2, "")
        assert err == (f"statechat: {cache / 'index.db'} is not a statechat cache index (it "
                       "holds other tables: notes); pick another cache dir\n")
    assert (cache / "index.db").read_bytes() == before


def test_an_index_reloaded_without_its_schema_version_is_read(tmp_path, shared_engine,
                                                             monkeypatch, capsys):
    """An index whose schema version a `sqlite3 .dump` reload lost (an engine takes it, as its
    own) is read by `stats` and `ls` as it is (they said it was empty)."""
    import json
    import sqlite3

    from tests.cli.test_commands import warm_cache

    cache = warm_cache(tmp_path)
    want = json.loads(run_cli(monkeypatch, capsys, ["cache", "stats", "--json", "--cache-dir",
                                                    str(cache)])[1])
    assert want["num_checkpoints"] >= 1
    with sqlite3.connect(cache / "index.db") as conn:
        conn.execute("PRAGMA user_version = 0")
    code, out, _ = run_cli(monkeypatch, capsys, ["cache", "stats", "--json", "--cache-dir",
                                                 str(cache)])
    assert code == 0
    got = json.loads(out)
    assert [got[k] for k in ("num_checkpoints", "num_blocks", "bytes_total")] == \
        [want[k] for k in ("num_checkpoints", "num_blocks", "bytes_total")]
    code, out, _ = run_cli(monkeypatch, capsys, ["cache", "ls", "--json", "--cache-dir",
                                                 str(cache)])
    assert code == 0 and len(json.loads(out)) == want["num_checkpoints"]
