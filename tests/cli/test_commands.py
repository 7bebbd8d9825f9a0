"""The command line: every command's --help explains its options, and the `cache` commands
report on a cache dir (when the persistent store is part of this build)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from statechat import cli

runner = CliRunner()


@pytest.mark.parametrize("argv, needles", [
    ([], ["run", "batch", "serve", "cache"]),
    (["run"], ["--model", "--cache-dir", "--device"]),
    (["batch"], ["--output", "--no-cache", "--max-tokens", "--temperature", "--seed", "--model"]),
    (["serve"], ["--host", "--port", "--api-key", "STATECHAT_API_KEY", "--model", "--cache-dir"]),
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
