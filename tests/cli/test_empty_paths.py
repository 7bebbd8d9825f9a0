"""An empty path flag (`--cache-dir "$DIR"` with DIR unset) is one line that names the flag,
before anything starts: not the current folder, which `Path("")` names (a cache made there,
beside whatever the folder held, or `. has no config.json` for --model)."""

from __future__ import annotations

import pytest

from statechat import cli, cli_setup


@pytest.mark.parametrize("argv, flag", [
    (["batch", "IN", "--cache-dir", ""], "--cache-dir"),
    (["batch", "IN", "--model", " "], "--model"),
    (["serve", "--cache-dir", ""], "--cache-dir"),
    (["run", "--model", ""], "--model"),
    (["cache", "ls", "--cache-dir", ""], "--cache-dir"),
    (["cache", "clear", "--yes", "--cache-dir", ""], "--cache-dir"),
    (["cache", "path", "--cache-dir", ""], "--cache-dir"),
])
def test_an_empty_path_flag_is_one_line_naming_it(argv, flag, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_setup, "load_engine", lambda config: pytest.fail("the model loaded"))
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "in.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    argv = [str(src) if a == "IN" else a for a in argv]
    device = [] if argv[0] == "cache" else ["--device", "cpu"]
    monkeypatch.setattr("sys.argv", ["statechat", *argv, *device])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"statechat: {flag} is empty; ") and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # (nothing made here)


def test_an_empty_cache_dir_variable_is_the_default_still(tmp_path, monkeypatch, capsys):
    """STATECHAT_CACHE_DIR= (set, empty) is unset, as for every variable of the CLI's."""
    monkeypatch.setenv("STATECHAT_CACHE_DIR", "")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setattr("sys.argv", ["statechat", "cache", "path"])
    cli.main()
    assert capsys.readouterr().out.strip() == str(tmp_path / "data" / "statechat")


def test_a_path_flag_given_still_reads_as_given(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["statechat", "cache", "path", "--cache-dir",
                                     str(tmp_path / "c")])
    cli.main()
    assert capsys.readouterr().out.strip() == str(tmp_path / "c")

