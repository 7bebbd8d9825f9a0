"""The sampling flags of `run`, `batch` and `serve` (--temperature, --top-p, --top-k, --min-p,
the three penalties, --max-tokens) set the sampling of every request of that run: over the
command's own defaults and the model's recommended sampling (generation_config.json), under a
request's or a batch line's own fields. A bad flag is one line before any model loads. `serve`
names a checkpoint of the Hugging Face cache by its repo id, as vLLM does."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from statechat import cli, cli_setup
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.paths import EMBEDDED_MODEL

QWEN_LIKE = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}  # what Qwen's checkpoints carry


def recommending(tmp_path, **sampling):
    """A copy of the embedded model whose generation_config.json recommends `sampling`."""
    path = shutil.copytree(EMBEDDED_MODEL, tmp_path / "model")
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, **sampling}))
    return path


@pytest.fixture
def started(monkeypatch, shared_engine):
    """The sampling `run` hands its app and `serve` its server (neither is started)."""
    got = {}

    class App:
        return_code = 0
        is_closed = True

        def __init__(self, config, chat_dir, sampling=None, template_kwargs=None,
                     system_prompt=None) -> None:
            got["run"] = sampling

        def run(self) -> None:
            pass

    def serve(worker, model_id, host, port, api_key=None, template_kwargs=None, sampling=None,
              completion_max_tokens=None, warm_next_turn=True, allowed_origins=None,
              sock=None, reasoning_parser=None, tool_call_parser=None, **kwargs):
        worker.shutdown()
        sock.close()
        got["serve"], got["model_id"] = sampling, model_id
        got["completion_max_tokens"] = completion_max_tokens
        got["warm_next_turn"] = warm_next_turn

    if importlib.util.find_spec("textual") is not None:  # (not on every GPU machine)
        monkeypatch.setattr("statechat.tui.app.StatechatApp", App)
        monkeypatch.setattr("statechat.tui.terminal.require_terminal", lambda: None)  # (the
        # runner's streams are no terminal)
    monkeypatch.setattr("statechat.api_serve.serve", serve)
    monkeypatch.setenv("STATECHAT_PORT", "0")  # (serve binds its port: any free one)
    return got


@pytest.mark.parametrize("command, own", [
    ("run", SamplingParams(temperature=0.7, top_p=0.95, max_tokens=1024)),
    ("serve", SamplingParams(temperature=1.0, top_p=1.0, max_tokens=2048)),
])
def test_run_and_serve_take_the_model_s_sampling_under_their_flags(tmp_path, started, command, own):
    if command == "run":
        pytest.importorskip("textual")
    args = [command, "--device", "cpu", "--no-cache"]
    plain = CliRunner().invoke(cli.app, [*args, "--model", str(EMBEDDED_MODEL)])
    assert plain.exit_code == 0, plain.output
    assert started[command] == own  # the tiny model recommends nothing: as before
    model = recommending(tmp_path, **QWEN_LIKE, do_sample=False)
    flags = ["--top-k", "5", "--min-p", "0.05", "--presence-penalty", "1.5",
             "--frequency-penalty", "-0.5", "--repetition-penalty", "1.1", "--max-tokens", "64"]
    result = CliRunner().invoke(cli.app, [*args, "--model", str(model), *flags])
    assert result.exit_code == 0, result.output
    assert started[command] == SamplingParams(
        temperature=0.6, top_p=0.95, top_k=5, min_p=0.05, presence_penalty=1.5,
        frequency_penalty=-0.5, repetition_penalty=1.1, max_tokens=64)
    if command == "serve":  # (a text completion's default too)
        assert started["completion_max_tokens"] == 64
    assert "sampling with temperature 0.6, top_p 0.95 by default, as the model's " \
           "generation_config.json recommends" in result.stderr
    off = CliRunner().invoke(cli.app, [*args, "--model", str(model), "--temperature", "0",
                                       "--top-k", "-1"])
    assert off.exit_code == 0, off.output
    assert (started[command].temperature, started[command].top_k) == (0.0, 0)  # -1 is off


def test_batch_takes_the_model_s_sampling_under_its_flags_and_lines(tmp_path, shared_engine):
    user = {"messages": [{"role": "user", "content": "state cache block token " * 8}],
            "max_tokens": 12}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"

    def batch(model, *flags, lines=({"id": "x"},)) -> list[dict]:
        src.write_text("\n".join(json.dumps({**user, **line}) for line in lines) + "\n")
        args = ["batch", str(src), "-o", str(out), "--model", str(model), "--device", "cpu",
                "--no-cache", *flags]
        result = CliRunner().invoke(cli.app, args)
        assert result.exit_code == 0, result.output
        return [json.loads(line) for line in out.read_text().splitlines()]

    [greedy] = batch(EMBEDDED_MODEL)  # batch's own: greedy
    assert len(greedy["text"]) > 8
    [hot] = batch(EMBEDDED_MODEL, "--temperature", "1.5", "--seed", "3")
    assert hot["text"] != greedy["text"]
    model = recommending(tmp_path, temperature=1.5)
    recommended, own, penalised, bad = batch(model, "--seed", "3", lines=(
        {"id": "model's"}, {"id": "own", "temperature": 0},
        {"id": "penalised", "presence_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.1},
        {"id": "bad", "min_p": 2}))
    assert recommended["text"] == hot["text"]  # the model's temperature, as the flag's was
    assert own["text"] == greedy["text"]  # a line's own field wins
    assert penalised["usage"]["completion_tokens"] >= 1
    assert bad["error"]["message"] == "min_p must be in [0, 1], got 2.0"
    [flagged] = batch(model, "--temperature", "0")
    assert flagged["text"] == greedy["text"]  # the flag wins over the model
    [top1] = batch(model, "--top-k", "1")
    assert top1["text"] == greedy["text"]


@pytest.mark.parametrize("command", ["run", "batch", "serve"])
@pytest.mark.parametrize("flag, value, says", [
    ("--min-p", "2", "--min-p must be in [0, 1], got 2.0"),
    ("--top-k", "-2", "--top-k must be -1 or 0 (off), or a positive count, got -2"),
    ("--repetition-penalty", "0", "--repetition-penalty must be > 0, got 0.0"),
    ("--presence-penalty", "2.5", "--presence-penalty must be in [-2, 2], got 2.5"),
    ("--top-p", "inf", "--top-p must be a finite number, got inf"),
    ("--max-tokens", "-1", "--max-tokens must be >= {least}, got -1"),
])
def test_a_bad_flag_is_one_line_before_any_model_loads(tmp_path, monkeypatch, capsys, command,
                                                        flag, value, says):
    monkeypatch.setattr(cli_setup, "load_engine", lambda config: pytest.fail("the model loaded"))
    if command == "run":
        pytest.importorskip("textual")
        monkeypatch.setattr("statechat.tui.app.StatechatApp",
                            lambda *a, **k: pytest.fail("app made"))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    argv = [command, *([str(src)] if command == "batch" else []), "--device", "cpu",
            "--model", str(EMBEDDED_MODEL), flag, value]
    monkeypatch.setattr("sys.argv", ["statechat", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    least = 0 if command == "batch" else 1  # (batch's 0 scores each prompt alone)
    assert capsys.readouterr().err.strip() == f"statechat: {says.format(least=least)}"


def test_the_model_s_ignored_recommendations_are_said_as_statechat(tmp_path):
    """A value of generation_config.json that is left out is warned about with `statechat: `
    in front, as every other message (it came bare); the command goes on."""
    import subprocess
    import sys

    from tests.helpers import ROOT, subprocess_env

    model = recommending(tmp_path, temperature="hot", top_p=2)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    done = subprocess.run([sys.executable, "-m", "statechat.cli", "batch", str(empty), "--model",
                           str(model)], capture_output=True, text=True, env=subprocess_env(),
                          cwd=ROOT, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    config = model / "generation_config.json"
    assert done.stderr.splitlines() == [
        f"statechat: {config}: ignoring temperature 'hot' (it must be a number >= 0)",
        f"statechat: {config}: ignoring top_p 2 (it must be a number in (0, 1])",
        f"statechat: {empty} has no requests"]


STUB_RUN = """
import os
import sys
import statechat.tui.app
import statechat.tui.terminal
from statechat import cli
from statechat.engine.engine import LLMEngine


class App:  # stands for the TUI: prints, closes (or not) and ends with status 3
    return_code, is_closed = 3, sys.argv[1] == "closed"

    def __init__(self, *args, **kwargs) -> None:
        pass

    def run(self) -> None:
        print("the app's last words")  # (a pipe's buffer: lost unless flushed)


statechat.tui.app.StatechatApp = App
statechat.tui.terminal.require_terminal = lambda: None  # (the test's pipes are no terminal)
os._exit = lambda code, real=os._exit: (print("fast exit", file=sys.stderr), real(code))
sys.argv = ["statechat", "run", "--device", "cpu", "--no-cache", "--model", sys.argv[2]]
cli.main()
"""


def test_run_ends_the_process_at_once_after_its_app_closed():
    """Once `run`'s app has closed everything, the process ends without the interpreter's
    teardown (1-2 s after the screen is gone), with the app's exit status and its output to a
    pipe flushed; an app whose engine did not stop in time ends as sys.exit does."""
    import subprocess
    import sys

    from tests.helpers import ROOT, subprocess_env

    pytest.importorskip("textual")
    for state, fast in (("closed", True), ("open", False)):
        done = subprocess.run([sys.executable, "-c", STUB_RUN, state, str(EMBEDDED_MODEL)],
                              capture_output=True, text=True, env=subprocess_env(), cwd=ROOT,
                              timeout=300, check=False)
        assert done.returncode == 3, done.stderr
        assert done.stdout == "the app's last words\n"
        assert ("fast exit" in done.stderr) == fast


@pytest.mark.parametrize("flag, warm", [([], True), (["--no-warm-next-turn"], False)])
def test_serve_warms_the_next_turn_unless_told_not_to(started, flag, warm):
    result = CliRunner().invoke(cli.app, ["serve", "--device", "cpu", "--no-cache", "--model",
                                          str(EMBEDDED_MODEL), *flag])
    assert result.exit_code == 0, result.output
    assert started["warm_next_turn"] is warm


def test_serve_names_a_hugging_face_cache_snapshot_by_its_repo_id(tmp_path, started, loaded,
                                                                  monkeypatch):
    """(It was named by the snapshot's commit hash, in /v1/models and in every response.)"""
    monkeypatch.setattr(cli_setup, "load_engine", lambda config: LLMEngine(
        config, loaded=dataclasses.replace(loaded, path=config.model)))  # (loaded from there)
    hub = tmp_path / "hub" / "models--Qwen--Qwen3.5-0.8B" / "snapshots"
    snapshot = shutil.copytree(EMBEDDED_MODEL, hub / "9c3f1b2e4d5a67b8c9d0e1f2a3b4c5d6e7f8a9b0")
    for model, name in ((snapshot, "Qwen/Qwen3.5-0.8B"), (EMBEDDED_MODEL, EMBEDDED_MODEL.name)):
        result = CliRunner().invoke(cli.app, ["serve", "--device", "cpu", "--no-cache",
                                              "--model", str(model)])
        assert result.exit_code == 0, result.output
        assert started["model_id"] == name


def test_a_snapshot_given_as_a_relative_path_is_named_by_its_repo_id(tmp_path, monkeypatch):
    """`serve --model .` inside a snapshot served the model as '' (the name of '.')."""
    from statechat.paths import served_name

    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3.5-0.8B" / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    monkeypatch.chdir(snapshot)
    assert [served_name(Path(p)) for p in (".", "./", f"../{'ab' * 20}")] == [
        "Qwen/Qwen3.5-0.8B"] * 3
    monkeypatch.chdir(tmp_path)
    assert served_name(Path(".")) == tmp_path.name
