"""`statechat cache ls --json | head -1` (and every other command whose standard output's
reader goes away) ends quietly, as `cat` does: no error line, no traceback, exit status 141
(SIGPIPE's, as a shell reports it), as `batch` does (test_batch_broken_pipe.py). It ended with
exit status 1, from Typer's own handling of a broken pipe. The help of every command
(`statechat --help | head -1`, a group's help shown for want of a command) ends so too: it
ended with exit status 1, from Rich's."""

from __future__ import annotations

import os

import pytest

from statechat import cli
from tests.cli.test_commands import warm_cache


def run_into_closed_pipe(monkeypatch, argv: list[str]) -> int:
    """The command's exit status, its standard output a pipe whose reader has gone."""
    read, write = os.pipe()
    os.close(read)
    stdout = open(write, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    monkeypatch.setattr("sys.stdout", stdout)
    monkeypatch.setattr("sys.argv", ["statechat", *argv])
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
    finally:
        monkeypatch.undo()
        stdout.close()
    return exit_info.value.code


@pytest.mark.parametrize("argv", [["ls", "--json"], ["stats"], ["verify"]])
def test_cache_commands_end_quietly_when_the_reader_goes(tmp_path, shared_engine, monkeypatch,
                                                          capsys, argv):
    cache = warm_cache(tmp_path)
    assert run_into_closed_pipe(monkeypatch, ["cache", *argv, "--cache-dir", str(cache)]) == 141
    assert capsys.readouterr().err == ""


def test_version_ends_quietly_when_the_reader_goes(monkeypatch, capsys):
    assert run_into_closed_pipe(monkeypatch, ["--version"]) == 141
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv", [["--help"], ["cache", "--help"], ["cache", "gc", "--help"],
                                  ["batch", "--help"], [], ["cache"]])
def test_help_ends_quietly_when_the_reader_goes(monkeypatch, capsys, argv):
    assert run_into_closed_pipe(monkeypatch, argv) == 141
    assert capsys.readouterr().err == ""
