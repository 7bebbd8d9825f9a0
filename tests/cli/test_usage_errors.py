"""A usage error (a flag's bad value, an unknown flag or command, a missing argument) is one line
on stderr that says what was wrong and where the help is, with exit status 2, as every other
error of statechat's is one line (click printed four: usage, hint, a blank line, the error).
A command group given no arguments still shows its help."""

from __future__ import annotations

import pytest

from statechat import cli


@pytest.mark.parametrize("argv, said", [
    (["batch", "in.jsonl", "--seed", "abc"], "Invalid value for '--seed'"),
    (["cache", "ls", "--limit", "0"], "Invalid value for '--limit'"),
    (["run", "--bogus"], "No such option: --bogus"),
    (["bogus"], "No such command 'bogus'"),
    (["batch"], "Missing argument 'input'"),
])
def test_a_usage_error_is_one_line(argv, said, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("STATECHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("sys.argv", ["statechat", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"statechat: {said}") and "--help')" in err, err


def test_a_group_with_no_arguments_shows_its_help(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("STATECHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("sys.argv", ["statechat", "cache"])
    with pytest.raises(SystemExit):
        cli.main()
    out, err = capsys.readouterr()
    assert "Usage:" in out + err and "ls" in out + err
