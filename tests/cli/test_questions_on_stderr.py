"""The questions `cache clear` and `chats rm` ask go to standard error, as `rm -i`'s do: with
standard output sent to a file (`statechat cache clear > log`) the question is still seen, and
standard output holds only what was done."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from statechat import cli, cli_chats
from tests.cli.test_chats import chats, seed
from tests.cli.test_commands import warm_cache

runner = CliRunner()


def test_cache_clear_asks_on_stderr(tmp_path, shared_engine):
    cache = warm_cache(tmp_path)
    result = runner.invoke(cli.app, ["cache", "clear", "--cache-dir", str(cache)], input="y\n")
    assert result.exit_code == 0, result.output
    assert "Delete every cache entry" in result.stderr
    assert "Delete" not in result.stdout and result.stdout.splitlines()[-1].startswith("freed ")


def test_chats_rm_asks_on_stderr(tmp_path, monkeypatch):
    ids = seed(tmp_path / "cache")
    monkeypatch.setattr(cli_chats, "has_terminal", lambda: True)
    result = chats(tmp_path, "rm", "Plans", input="y\n")
    assert result.exit_code == 0, result.stderr
    assert "Delete chat" in result.stderr
    # (CliRunner echoes the answer typed to stdout, as a terminal shows what is typed)
    assert "Delete" not in result.stdout
    assert result.stdout.splitlines()[-1] == f"deleted chat {ids['plans']} (Plans)"
    listed = json.loads(chats(tmp_path, "ls", "--json").stdout)
    assert ids["plans"] not in [c["id"] for c in listed]
