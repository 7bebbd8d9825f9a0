"""`--system-prompt` (`-sys`, $STATECHAT_SYSTEM_PROMPT) and `--system-prompt-file` (`-sysf`):
`run` hands the text to the app (empty or blank: none); a file that is missing, unreadable or
not UTF-8 is one line and nothing starts; `batch` puts it before the messages of each line that
has no system message of its own, and a line with one keeps it."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from statechat import cli
from statechat.batch_lines import BatchDefaults, parse_lines
from statechat.paths import EMBEDDED_MODEL

runner = CliRunner()


@pytest.fixture
def app_made(monkeypatch):
    """`run`'s app replaced by a stand-in that records the arguments it was made with (nothing
    loads, no terminal is needed)."""
    pytest.importorskip("textual")
    made: list[dict] = []

    class App:
        return_code, is_closed = 0, True

        def __init__(self, *args, **kwargs) -> None:
            made.append(kwargs)

        def run(self) -> None:
            pass

    monkeypatch.setattr("statechat.tui.app.StatechatApp", App)
    monkeypatch.setattr("statechat.tui.terminal.require_terminal", lambda: None)
    return made


def run(*argv: str, env: dict | None = None):
    return runner.invoke(cli.app, ["run", "--device", "cpu", "--no-cache", "--model",
                                   str(EMBEDDED_MODEL), "--cache-dir", "unused", *argv], env=env)


@pytest.mark.parametrize("argv, env, given", [
    (["--system-prompt", "Answer in French."], None, "Answer in French."),
    (["-sys", "  Be terse.\n"], None, "Be terse."),
    ([], {"STATECHAT_SYSTEM_PROMPT": "From the environment."}, "From the environment."),
    (["--system-prompt", "   \n "], None, None),
    ([], None, None),
])
def test_run_hands_the_system_prompt_to_the_app(app_made, argv, env, given):
    result = run(*argv, env=env)
    assert result.exit_code == 0, result.output
    assert app_made[0]["system_prompt"] == given


def test_run_reads_the_system_prompt_from_a_file(app_made, tmp_path):
    path = tmp_path / "system.txt"
    path.write_text("\ufeffYou are a careful assistant.\nAnswer briefly.\n", encoding="utf-8")
    result = run("--system-prompt-file", str(path))
    assert result.exit_code == 0, result.output
    assert app_made[0]["system_prompt"] == "You are a careful assistant.\nAnswer briefly."
    # (a file given on the command line wins over the environment's text)
    result = run("-sysf", str(path), env={"STATECHAT_SYSTEM_PROMPT": "other"})
    assert result.exit_code == 0, (result.output, result.exception)
    assert app_made[1]["system_prompt"] == "You are a careful assistant.\nAnswer briefly."


def bad_file(tmp_path, kind: str) -> tuple[str, str]:
    """A --system-prompt-file that cannot be used, and what the error says of it."""
    path = tmp_path / "system.txt"
    if kind == "missing":
        return str(path), f"--system-prompt-file {path} does not exist"
    if kind == "folder":
        path.mkdir()
        return str(path), f"--system-prompt-file {path} is a folder; pass a text file"
    if kind == "not utf-8":
        path.write_bytes(b"caf\xe9\n")
        return str(path), (f"--system-prompt-file {path} is not UTF-8 text (byte 4); save it "
                           "as UTF-8")
    path.write_text("secret")
    path.chmod(0)
    return str(path), f"--system-prompt-file {path} cannot be read (Permission denied)"


@pytest.mark.parametrize("kind", ["missing", "folder", "not utf-8", "unreadable"])
def test_a_system_prompt_file_that_cannot_be_used_is_one_line_before_anything_starts(
        app_made, tmp_path, kind, monkeypatch, capsys):
    path, says = bad_file(tmp_path, kind)
    if kind == "unreadable" and os.access(path, os.R_OK):  # (root reads any file)
        pytest.skip("this user reads files whatever their mode")
    monkeypatch.setattr("sys.argv", ["statechat", "run", "--device", "cpu", "--no-cache",
                                     "--model", str(EMBEDDED_MODEL), "--system-prompt-file", path])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2 and not app_made
    assert capsys.readouterr().err.strip() == f"statechat: {says}"


def test_both_flags_on_the_command_line_are_one_line(app_made, tmp_path, monkeypatch, capsys):
    path = tmp_path / "system.txt"
    path.write_text("from the file")
    monkeypatch.setattr("sys.argv", ["statechat", "run", "--device", "cpu", "--no-cache",
                                     "--system-prompt", "text", "--system-prompt-file", str(path)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2 and not app_made
    assert capsys.readouterr().err.strip() == (
        "statechat: give --system-prompt or --system-prompt-file, not both")


@pytest.mark.parametrize("command", ["run", "batch"])
def test_help_shows_the_system_prompt_flags(command):
    result = runner.invoke(cli.app, [command, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    for needle in ("--system-prompt", "-sys", "--system-prompt-file", "-sysf",
                   "STATECHAT_SYSTEM_PROMPT"):
        assert needle in result.output, f"{needle} missing from `statechat {command} --help`"


LINES = [json.dumps({"id": "plain", "messages": [{"role": "user", "content": "hi"}]}),
         json.dumps({"id": "own", "messages": [{"role": "developer", "content": "Mine."},
                                               {"role": "user", "content": "hi"}]})]


def test_batch_puts_the_system_prompt_before_lines_that_have_none():
    plain, own = parse_lines(LINES, BatchDefaults(system_prompt="Be brief."))
    assert plain.messages == [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "hi"}]
    assert own.messages == [{"role": "system", "content": "Mine."},
                            {"role": "user", "content": "hi"}]


def test_batch_s_system_prompt_reaches_the_model(tmp_path, shared_engine):
    """A line without a system message, run with --system-prompt, is the prompt of a line that
    has that system message itself (the same prompt tokens, the same greedy reply)."""
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        LINES[0],
        json.dumps({"id": "written", "messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "hi"}]}),
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    result = runner.invoke(cli.app, ["batch", str(src), "-o", str(out), "--device", "cpu",
                                     "--no-cache", "--model", str(EMBEDDED_MODEL),
                                     "--max-tokens", "4", "--system-prompt", "Be brief."])
    assert result.exit_code == 0, result.output
    plain, written = (json.loads(line) for line in out.read_text().splitlines())
    assert plain["usage"] == written["usage"] and plain["text"] == written["text"]
