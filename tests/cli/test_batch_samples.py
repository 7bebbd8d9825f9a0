"""`statechat batch` lines with "n", "include_stop_str_in_output" and "skip_special_tokens": a
line for n samples gets one result whose "choices" hold them (index, text, finish_reason,
stop_reason, each sample's cached and completion tokens), its own fields sample 0's, which is
the n=1 line's reply; greedy samples are identical, seeded ones reproducible and as the
server's (sample i seeded with seed + i); usage counts the prompt once and every sample's
tokens, and the samples after the first reuse the prompt sample 0 computed. A kept stop string
ends the text, and special tokens' text shows when not skipped."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from statechat import cli
from statechat.paths import EMBEDDED_MODEL

USER = {"messages": [{"role": "user", "content": " ".join(["state cache block token"] * 40)}],
        "max_tokens": 8, "ignore_eos": True}


def run(tmp_path, lines: list[dict], *flags: str) -> list[dict]:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(cli.app, ["batch", str(src), "-o", str(out), "--model",
                                          str(EMBEDDED_MODEL), "--device", "cpu", *flags])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_a_line_for_n_samples_gets_them_as_choices(tmp_path, shared_engine):
    one, greedy, hot, hot_again, hot_one = run(tmp_path, [
        USER, {**USER, "n": 2}, {**USER, "n": 3, "temperature": 1.0, "seed": 5},
        {**USER, "n": 3, "temperature": 1.0, "seed": 5},
        {**USER, "temperature": 1.0, "seed": 6}], "--cache-dir", str(tmp_path / "cache"))
    assert "choices" not in one
    assert [c["index"] for c in greedy["choices"]] == [0, 1]
    assert [c["text"] for c in greedy["choices"]] == [one["text"]] * 2 == [greedy["text"]] * 2
    assert greedy["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert greedy["usage"]["completion_tokens"] == 16
    texts = [c["text"] for c in hot["choices"]]
    assert texts == [c["text"] for c in hot_again["choices"]] and len(set(texts)) > 1
    assert texts[1] == hot_one["text"]  # (sample 1: seed 5 + 1)
    # each sample after the first reuses what sample 0 computed of the prompt (the cache
    # holds whatever earlier lines left; these reuse at least the block-aligned prompt)
    prompt = hot["usage"]["prompt_tokens"]
    assert all(c["cached_tokens"] >= (prompt - 1) // 64 * 64 for c in hot["choices"][1:])
    assert [c["completion_tokens"] for c in hot["choices"]] == [8] * 3


def test_a_line_keeps_its_stop_and_special_tokens(tmp_path, shared_engine):
    (full,) = run(tmp_path, [USER], "--no-cache")
    stop = full["text"][4:6]
    cut = full["text"].index(stop)
    kept, dropped, special = run(tmp_path, [
        {**USER, "stop": stop, "include_stop_str_in_output": True}, {**USER, "stop": stop},
        {**USER, "logit_bias": {"2": 100}, "ignore_eos": False, "skip_special_tokens": False,
         "include_stop_str_in_output": True}], "--no-cache")
    assert (kept["text"], kept["stop_reason"]) == (full["text"][: cut + len(stop)], stop)
    assert (dropped["text"], dropped["stop_reason"]) == (full["text"][:cut], stop)
    assert (special["text"], special["finish_reason"]) == ("<|im_end|>", "stop")
