"""The command line: every command's --help explains its options, and the `cache` commands
report on a cache dir (when the persistent store is part of this build)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from statechat import cli
from statechat.paths import EMBEDDED_MODEL

runner = CliRunner()
SAMPLING_FLAGS = ["--temperature", "--top-p", "--top-k", "--min-p", "--presence-penalty",
                  "--frequency-penalty", "--repetition-penalty", "--max-tokens"]
ENGINE_FLAGS = ["--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                "--memory-fraction", "--dtype"]


@pytest.mark.parametrize("argv, needles", [
    ([], ["run", "batch", "serve", "cache"]),
    (["run"], ["--model", "--cache-dir", "--device", "--chat-template-kwargs", *SAMPLING_FLAGS,
               *ENGINE_FLAGS]),
    (["batch"], ["--output", "--no-cache", "--seed", "--model", "--chat-template-kwargs",
                 *SAMPLING_FLAGS, *ENGINE_FLAGS]),
    (["serve"], ["--host", "--port", "--api-key", "STATECHAT_API_KEY", "--model", "--cache-dir",
                 "--chat-template-kwargs", *SAMPLING_FLAGS, *ENGINE_FLAGS]),
    (["cache"], ["path", "stats", "ls", "verify", "gc", "clear"]),
    (["cache", "gc"], ["--max-bytes", "--cache-dir"]),
])
def test_help_explains_options(argv, needles):
    result = runner.invoke(cli.app, [*argv, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    for needle in needles:
        assert needle in result.output, f"{needle} missing from `statechat {' '.join(argv)} --help`"


def test_cache_commands(tmp_path):
    pytest.importorskip("statechat.cache.store", reason="the persistent cache store is not in this build")
    cache = ["--cache-dir", str(tmp_path)]
    path = runner.invoke(cli.app, ["cache", "path", *cache])
    assert path.exit_code == 0 and path.output.strip() == str(tmp_path)
    stats = runner.invoke(cli.app, ["cache", "stats", "--json", *cache])
    assert stats.exit_code == 0, stats.output
    assert {"num_checkpoints", "bytes_total", "bytes_budget"} <= set(json.loads(stats.output))
    human = runner.invoke(cli.app, ["cache", "stats", *cache])
    assert human.exit_code == 0 and "checkpoints" in human.output
    for argv in (["ls"], ["ls", "--json"], ["verify"], ["gc", "--max-bytes", "0"], ["clear", "--yes"]):
        result = runner.invoke(cli.app, ["cache", *argv, *cache])
        assert result.exit_code == 0, (argv, result.output)
    assert "checked" in runner.invoke(cli.app, ["cache", "verify", *cache]).output
    assert "freed" in runner.invoke(cli.app, ["cache", "clear", "--yes", *cache]).output
    refused = runner.invoke(cli.app, ["cache", "clear", *cache], input="n\n")
    assert refused.exit_code != 0


def test_cache_commands_do_not_create_a_missing_cache_dir(tmp_path):
    """The cache commands only read or delete: on a cache dir that does not exist yet they
    report an empty cache (a note on stderr says there is none) and leave no folder behind."""
    pytest.importorskip("statechat.cache.store", reason="the persistent cache store is not in this build")
    missing = tmp_path / "not-yet"
    cache = ["--cache-dir", str(missing)]
    assert runner.invoke(cli.app, ["cache", "path", *cache]).output.strip() == str(missing)
    stats = runner.invoke(cli.app, ["cache", "stats", "--json", *cache])
    assert stats.exit_code == 0 and json.loads(stats.stdout)["num_checkpoints"] == 0
    made = runner.invoke(cli.app, ["cache", "stats", "--json", "--cache-dir", str(tmp_path)])
    assert json.loads(stats.stdout).keys() == json.loads(made.stdout).keys()  # the same fields
    assert f"no cache at {missing} yet" in stats.stderr
    for argv, says in ((["stats"], "checkpoints  0"), (["ls"], "(no checkpoints yet)"), (["ls", "--json"], "[]"),
                       (["verify"], "checked 0"), (["gc"], "freed 0 B"), (["clear"], "freed 0 B")):
        result = runner.invoke(cli.app, ["cache", *argv, *cache])
        assert result.exit_code == 0 and says in result.stdout, (argv, result.output)
    assert not missing.exists()


def test_a_cache_dir_that_cannot_be_opened_is_one_line(tmp_path, monkeypatch, capsys):
    """A file where the cache folder should be, or an index that is not a database: one line
    that says what to do, from every cache command (they were SQLite tracebacks)."""
    pytest.importorskip("statechat.cache.store", reason="the persistent cache store is not in this build")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "index.db").write_bytes(b"not a database at all" * 100)
    for cache_dir, says in [(a_file, "is a file; pass a folder"), (garbage, "file is not a database")]:
        for command in ("stats", "ls", "verify"):
            monkeypatch.setattr("sys.argv", ["statechat", "cache", command, "--cache-dir", str(cache_dir)])
            with pytest.raises(SystemExit) as exit_info:
                cli.main()
            err = capsys.readouterr().err.strip()
            assert exit_info.value.code == 2 and says in err and "\n" not in err, (command, err)
    assert (garbage / "index.db").read_bytes().startswith(b"not a database")  # left as it was


@pytest.mark.parametrize("argv, says", [
    (["run", "--device", "tpu"], "unknown device 'tpu'; choose one of auto, cpu, cuda, npu"),
    (["serve", "--device", "tpu"], "unknown device 'tpu'; choose one of auto, cpu, cuda, npu"),
    (["run", "--model", "/nonexistent"], "model directory /nonexistent does not exist"),
    (["run", "--memory-fraction", "2"], "--memory-fraction must be in [0.05, 0.98], got 2.0"),
    (["serve", "--dtype", "float64"],
     "--dtype must be float32, bfloat16 or float16, got 'float64'"),
    (["run", "--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
    (["serve", "--max-model-len", "1"], "--max-model-len must be at least 2 tokens, got 1"),
    (["run", "--max-num-batched-tokens", "32"],
     "--max-num-batched-tokens must be at least one block (64 tokens), got 32"),
    (["run", "--model", str(EMBEDDED_MODEL), "--max-model-len", "100000"],
     "--max-model-len 100,000 exceeds the model's 8,192 positions; lower --max-model-len"),
])
def test_a_wrong_device_or_model_is_one_line_before_anything_starts(argv, says, monkeypatch, capsys):
    """(`run` showed its loading screen first, and took the error from its worker thread.)"""
    monkeypatch.setattr("sys.argv", ["statechat", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"statechat: {says}"
