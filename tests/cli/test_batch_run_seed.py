"""`statechat batch --seed S` makes a run reproducible while its lines still differ: a line
without its own seed draws one made from S and its line number, so identical lines (how a
batch asks for several samples) give different samples, the same file and S give the same
outputs again, and a line's own seed still wins."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from statechat import cli
from statechat.batch_lines import BatchDefaults, parse_lines
from statechat.engine.sampling import SamplingParams
from statechat.paths import EMBEDDED_MODEL

LINE = {"messages": [{"role": "user", "content": "tell me about the state cache"}],
        "max_tokens": 12, "temperature": 1.0}


def seeds(*lines: dict, seed: int | None = 7) -> list[int | None]:
    defaults = BatchDefaults(SamplingParams(temperature=0.0, max_tokens=256, seed=seed))
    return [job.params.seed for job in parse_lines(map(json.dumps, lines), defaults)]


def test_each_line_draws_its_own_seed_from_the_run_s():
    first = seeds(LINE, LINE, LINE, {**LINE, "seed": 3}, {**LINE, "seed": None})
    assert len(set(first[:3] + first[4:])) == 4 and first[3] == 3  # (a line's own wins)
    assert seeds(LINE, LINE, LINE, {**LINE, "seed": 3}, {**LINE, "seed": None}) == first
    assert seeds(LINE, LINE, seed=8)[:2] != first[:2]  # (another run seed, other draws)
    assert seeds(LINE, LINE, seed=None) == [None, None]  # (no --seed: no seed, as before)


def test_identical_lines_give_different_samples_and_the_run_repeats(tmp_path, shared_engine):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, **LINE}) + "\n" for i in range(4)))
    args = ["batch", str(src), "-o", str(out), "--model", str(EMBEDDED_MODEL), "--device", "cpu",
            "--no-cache", "--seed", "11"]
    runs = []
    for _ in range(2):
        result = CliRunner().invoke(cli.app, args)
        assert result.exit_code == 0, result.output
        runs.append([json.loads(line)["text"] for line in out.read_text().splitlines()])
    assert runs[0] == runs[1]  # (reproducible)
    assert len(set(runs[0])) > 1, runs[0]  # (every line had the run's seed: one sample, 4 times)
