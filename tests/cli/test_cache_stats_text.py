"""`cache stats`' model lines count in English: "1 checkpoint, 1 block" for a model with one of
each (it said "1 checkpoints, 1 blocks"), plurals otherwise, thousands grouped."""

from __future__ import annotations

import contextlib

from typer.testing import CliRunner

from statechat import cli, cli_cache

runner = CliRunner()


class _Store:
    def stats(self) -> dict:
        model = {"name": "tiny", "id": 1, "dtype": "float32", "block_size": 64, "bytes": 10}
        return {"num_checkpoints": 2049, "num_blocks": 2049, "models": [
            {**model, "checkpoints": 1, "blocks": 1},
            {**model, "name": "other", "id": 2, "checkpoints": 2048, "blocks": 0}]}


def test_the_model_lines_say_one_checkpoint_and_several_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(cli_cache, "has_cache", lambda root: True)
    monkeypatch.setattr(cli_cache, "opened_store", lambda root: contextlib.nullcontext(_Store()))
    result = runner.invoke(cli.app, ["cache", "stats", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith("model")]
    assert ": 1 checkpoint, 1 block," in lines[0]
    assert ": 2,048 checkpoints, 0 blocks," in lines[1]
