"""The `cache` commands on odd cache dirs: a file in the cache dir's place or above it is the
same one line from every one of them (`cache path` printed it as the cache dir, and the others
under a file said `no cache at ... yet`, where none can ever be)."""

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
