"""`statechat chats show --help` says what --json prints (the branch's messages as JSON): it
said "instead of a table", and `show` prints no table."""

from __future__ import annotations

from typer.testing import CliRunner

from statechat import cli

runner = CliRunner()


def test_show_s_json_flag_says_what_it_prints():
    result = runner.invoke(cli.app, ["chats", "show", "--help"],
                           env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    options = [line.strip("│ ") for line in result.stdout.splitlines()]
    line = next(line for line in options if line.startswith("--json"))
    assert "table" not in line and "messages" in line, line
