"""`statechat batch`: 20 requests sharing prefixes give the same outputs with and without
--no-cache, report cached_tokens > 0 where prefixes repeat, keep input order, and a bad line
gets an error record while the rest still run."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from statechat import cli, cli_batch, cli_setup
from statechat.paths import EMBEDDED_MODEL

WORDS = ["state", "cache", "block", "token", "layer", "chat", "model", "prefix", "reuse", "delta",
         "gate", "kernel"]


def words(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


def requests() -> list[str]:
    """20 requests in 4 groups sharing a long system prompt, then two bad lines."""
    systems = [words(100 + g, 90) for g in range(4)]
    lines = []
    for i in range(20):
        msgs = [{"role": "system", "content": systems[i % 4]},
                {"role": "user", "content": f"question {i}: {words(i, 8)}"}]
        req = {"id": f"r{i}", "messages": msgs}
        if i % 5 == 0:
            req["max_tokens"] = 8
        lines.append(json.dumps(req))
    lines.insert(7, "{not json")
    lines.insert(12, json.dumps({"id": "bad-role",
                                 "messages": [{"role": "robot", "content": "x"}]}))
    return lines


def run_batch(tmp_path, name: str, *extra: str) -> list[dict]:
    src, out = tmp_path / "in.jsonl", tmp_path / f"{name}.jsonl"
    src.write_text("\n".join(requests()) + "\n")
    result = CliRunner().invoke(cli.app, [
        "batch", str(src), "--output", str(out), "--model", str(EMBEDDED_MODEL), "--device", "cpu",
        "--max-tokens", "16", "--temperature", "0", *extra,
    ])
    assert result.exit_code == 0, result.output  # two lines failed, not all
    assert "22/22" in result.stderr  # the progress bar counts every line
    assert "2 of 22 requests failed" in result.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_batch_same_outputs_with_and_without_cache(tmp_path, shared_engine):
    cached = run_batch(tmp_path, "cached", "--cache-dir", str(tmp_path / "cache"))
    plain = run_batch(tmp_path, "plain", "--no-cache")
    assert len(cached) == len(plain) == 22
    ids = [r["id"] for r in cached]
    assert ids[:7] == [f"r{i}" for i in range(7)] and ids[8] == "r7"  # input order
    errors = [r for r in cached if "error" in r]
    assert [(r["line"], r["id"]) for r in errors] == [(8, None), (13, "bad-role")]
    assert "not valid JSON" in errors[0]["error"]["message"]
    assert "role" in errors[1]["error"]["message"]
    for c, p in zip(cached, plain):
        assert c.get("text") == p.get("text") and c.get("finish_reason") == p.get("finish_reason")
    ok = [r for r in cached if "error" not in r]
    assert all(r["usage"]["cached_tokens"] > 0 for r in ok), [r["usage"] for r in ok]
    assert all(r["usage"]["cached_tokens"] < r["usage"]["prompt_tokens"] for r in ok)
    assert all(r["usage"]["cached_tokens"] == 0 for r in plain if "error" not in r)
    assert all(r["ttft_ms"] is not None and r["usage"]["completion_tokens"] >= 1 for r in ok)
    assert all(r["usage"]["completion_tokens"] <= 8 for r in ok if int(r["id"][1:]) % 5 == 0)


def test_a_group_s_results_say_where_its_shared_prefix_came_from(tmp_path, shared_engine):
    """A group's requests reuse its prefix from the device tier, where the warm-up put it; in a
    second run (a new engine) the warm-up loads it from disk, and the results say so (every
    request said "device" before)."""
    cache = ["--cache-dir", str(tmp_path / "cache")]
    for run, tier in (("first", None), ("second", "disk")):
        ok = [r for r in run_batch(tmp_path, run, *cache) if "error" not in r]
        shared = [r["cache"]["shared_prefix"] for r in ok]
        assert all(s["tokens"] % 64 == 0 and s["reused_tokens"] + s["computed_tokens"] ==
                   s["tokens"] for s in shared), shared
        assert all(s["reused_from"] == tier for s in shared), (run, shared)
        assert all(s["reused_tokens"] == (s["tokens"] if tier else 0) for s in shared), shared


def test_batch_stdout_and_missing_input(tmp_path, shared_engine, monkeypatch, capsys):
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"id": "x", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    result = CliRunner().invoke(cli.app, ["batch", str(src), "--model", str(EMBEDDED_MODEL),
                                          "--device", "cpu", "--no-cache", "--max-tokens", "4"])
    assert result.exit_code == 0
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["id"] == "x" and set(record) == {"id", "text", "finish_reason", "stop_reason",
                                                   "usage", "ttft_ms", "cache"}
    assert record["cache"] == {"reused_from": None, "reused_by_tier": {}, "plan": None}
    monkeypatch.setattr("sys.argv", ["statechat", "batch", str(tmp_path / "missing.jsonl")])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("statechat: ") and "missing.jsonl" in err and "\n" not in err


def test_a_line_sets_its_own_sampling(tmp_path, shared_engine):
    """top_k, top_p, seed and stop of a line reach its request (they were ignored)."""
    user = {"messages": [{"role": "user", "content": words(7, 30)}], "max_tokens": 12}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "greedy", **user}) + "\n")
    args = ["batch", str(src), "-o", str(out), "--model", str(EMBEDDED_MODEL), "--device", "cpu",
            "--no-cache"]
    assert CliRunner().invoke(cli.app, args).exit_code == 0
    greedy = json.loads(out.read_text())["text"]
    assert len(greedy) > 8
    lines = [{"id": "top1", **user, "temperature": 1.5, "top_k": 1},
             {"id": "stop", **user, "stop": greedy[4:8]},
             {"id": "seeded", **user, "temperature": 1.0, "top_p": 0.9, "seed": 3},
             {"id": "again", **user, "temperature": 1.0, "top_p": 0.9, "seed": 3},
             {"id": "bad", **user, "top_k": -2}]
    src.write_text("\n".join(map(json.dumps, lines)) + "\n")
    assert CliRunner().invoke(cli.app, args).exit_code == 0
    top1, stop, seeded, again, bad = [json.loads(line) for line in out.read_text().splitlines()]
    assert top1["text"] == greedy
    assert stop["text"] == greedy[:4] and stop["finish_reason"] == "stop"
    assert stop["stop_reason"] == greedy[4:8] and top1["stop_reason"] is None
    assert seeded["text"] == again["text"]
    # (-1 is off, as 0 is: "must be >= 0" was wrong about it)
    assert bad["error"]["message"] == "top_k must be -1 or 0 (off), or a positive count, got -2"


def test_a_line_asks_for_logprobs(tmp_path, shared_engine):
    """A line's "logprobs": k gives each generated token's entry with the k likeliest (the
    greedy token first among them); other lines have none, and k past 20 is a line error."""
    user = {"messages": [{"role": "user", "content": words(8, 30)}], "max_tokens": 6}
    lines = [{"id": "lp", **user, "logprobs": 2, "prompt_logprobs": 1}, {"id": "plain", **user},
             {"id": "bad", **user, "logprobs": 21}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(map(json.dumps, lines)) + "\n")
    args = ["batch", str(src), "-o", str(out), "--model", str(EMBEDDED_MODEL), "--device", "cpu"]
    assert CliRunner().invoke(cli.app, args).exit_code == 0
    lp, plain, bad = [json.loads(line) for line in out.read_text().splitlines()]
    entries = lp["logprobs"]
    assert len(entries) == lp["usage"]["completion_tokens"] == 6 and "logprobs" not in plain
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
               and e["logprob"] == e["top_logprobs"][0]["logprob"] <= 0 for e in entries)
    assert lp["text"] == plain["text"]
    assert "logprobs must be from 0 to 20" in bad["error"]["message"]
    # "prompt_logprobs": per prompt token, null first, then the token's and the likeliest's
    prompt = lp["prompt_logprobs"]
    assert len(prompt) == lp["usage"]["prompt_tokens"] and prompt[0] is None
    assert "prompt_logprobs" not in plain and lp["usage"]["cached_tokens"] == 0
    assert all(1 <= len(e) <= 2 and {v["rank"] for v in e.values()} >= {1} for e in prompt[1:])
    # --max-tokens 0 scores every prompt alone, as a line's "max_tokens": 0 does
    src.write_text(json.dumps({"id": "lp", **user, "max_tokens": None, "prompt_logprobs": 1})
                   + "\n")
    assert CliRunner().invoke(cli.app, [*args, "--max-tokens", "0"]).exit_code == 0
    [scored] = [json.loads(line) for line in out.read_text().splitlines()]
    assert scored["text"] == "" and scored["usage"]["completion_tokens"] == 0
    again = scored["prompt_logprobs"]  # (the same, to float32's rounding in another batch)
    assert [{k: v["rank"] for k, v in e.items()} for e in again[1:]] == \
        [{k: v["rank"] for k, v in e.items()} for e in prompt[1:]]
    assert [e[k]["logprob"] for e in again[1:] for k in e] == \
        pytest.approx([e[k]["logprob"] for e in prompt[1:] for k in e], abs=1e-4)


def test_template_variables_from_the_command_line_and_the_line(tmp_path, shared_engine, loaded,
                                                               monkeypatch):
    """--chat-template-kwargs sets variables of the chat template for every line; a line's own
    chat_template_kwargs win (here a template that says whether thinking is on)."""
    monkeypatch.setattr(loaded.tokenizer, "chat_template",
                        "{% if enable_thinking is defined and not enable_thinking %}"
                        "quick {% endif %}"
                        "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    user = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}
    lines = [{"id": "default", **user},
             {"id": "own", **user, "chat_template_kwargs": {"enable_thinking": True}},
             {"id": "bad", **user, "chat_template_kwargs": {"tokenize": False}}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(map(json.dumps, lines)) + "\n")
    args = ["batch", str(src), "-o", str(out), "--model", str(EMBEDDED_MODEL), "--device", "cpu",
            "--no-cache", "--chat-template-kwargs", '{"enable_thinking": false}']
    assert CliRunner().invoke(cli.app, args).exit_code == 0
    default, own, bad = [json.loads(line) for line in out.read_text().splitlines()]
    quick = len(loaded.tokenizer.encode("quick hello there"))
    assert default["usage"]["prompt_tokens"] == quick
    assert own["usage"]["prompt_tokens"] == len(loaded.tokenizer.encode("hello there")) < quick
    assert bad["error"]["message"] == "chat_template_kwargs may not set tokenize"
    refused = CliRunner().invoke(cli.app, [*args[:-1], "[1]"])
    assert (refused.exit_code != 0
            and "must be a JSON object" in str(refused.exception or refused.output))


def test_a_run_where_every_request_failed_exits_1(tmp_path, shared_engine, monkeypatch):
    """Lines that cannot run are error records and exit status 1; when the model is not
    needed to tell (bad JSON, roles, fields), it does not load (it loaded first)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("{not json\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]})
                   + "\n\n" + json.dumps({"messages": [{"role": "user", "content": "x"}],
                                           "top_p": 2}) + "\n")
    args = ["batch", str(src), "-o", str(out), "--model", str(EMBEDDED_MODEL), "--device", "cpu",
            "--no-cache"]
    with monkeypatch.context() as m:
        m.setattr(cli_setup, "load_engine", lambda config: pytest.fail("the model loaded"))
        result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 1
    assert "3 of 3 requests failed" in result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]  # written all the same
    assert [r["line"] for r in records] == [1, 2, 4]
    assert records[2]["error"]["message"] == "top_p must be in (0, 1], got 2.0"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}],
                               "logit_bias": {"999999999": 1}}) + "\n")  # (the model tells)
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 1 and "1 of 1 requests failed" in result.stderr


def test_odd_values_are_line_errors_and_the_output_is_replaced_only_by_a_finished_run(
        tmp_path, shared_engine, monkeypatch, capsys):
    """Values that once aborted the whole batch with a traceback are errors of their line; a
    results file is replaced only when the run ends, and paths that cannot take the results
    are refused before the model loads."""
    user = '{"messages": [{"role": "user", "content": "hi"}], '
    lines = [user + '"max_tokens": NaN}', user + '"max_tokens": Infinity}',
             user + '"temperature": 1' + "0" * 400 + "}",
             user + '"max_tokens": 1' + "0" * 5000 + "}",
             '{"messages": [{"role": "user", "content": "\\ud800"}]}', user + '"max_tokens": 2.5}',
             user + '"max_tokens": 3}']
    src, out = tmp_path / "odd.jsonl", tmp_path / "out.jsonl"
    src.write_text("\ufeff" + "\n".join(lines) + "\n")  # (a byte-order mark is read past)
    out.write_text("an earlier run's results\n")
    args = ["batch", str(src), "--model", str(EMBEDDED_MODEL), "--device", "cpu", "--no-cache"]
    result = CliRunner().invoke(cli.app, [*args, "-o", str(out)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert ["error" in r for r in records] == [True] * 6 + [False]
    assert all("\n" not in r["error"]["message"] for r in records[:6])
    assert "not valid Unicode" in records[4]["error"]["message"]
    assert records[6]["usage"]["completion_tokens"] <= 3
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []
    for bad, says in [(src, "is the input file"), (tmp_path, "is a folder"),
                      (tmp_path / "nowhere" / "x.jsonl", "does not exist")]:
        monkeypatch.setattr(cli_setup, "load_engine",
                            lambda config: pytest.fail("the model loaded"))
        monkeypatch.setattr("sys.argv", ["statechat", *args, "-o", str(bad)])
        with pytest.raises(SystemExit):
            cli.main()
        err = capsys.readouterr().err.strip()
        assert says in err and "\n" not in err


def test_a_failed_run_keeps_the_earlier_results_and_links_are_written_through(
        tmp_path, shared_engine, monkeypatch, capsys):
    import statechat.batch

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.0})
                   + "\n")
    out.write_text("an earlier run's results\n")
    args = ["statechat", "batch", str(src), "--model", str(EMBEDDED_MODEL), "--device", "cpu",
            "--no-cache"]

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(statechat.batch, "run_batch", fail)
        m.setattr("sys.argv", [*args, "-o", str(out)])
        with pytest.raises(OSError):
            cli.main()
    assert out.read_text() == "an earlier run's results\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]  # no temp left
    link = tmp_path / "link.jsonl"
    link.symlink_to(out)
    monkeypatch.setattr("sys.argv", [*args, "-o", str(link)])
    cli.main()
    assert link.is_symlink() and json.loads(out.read_text())["usage"]["completion_tokens"] == 2
    monkeypatch.setattr(cli_setup, "load_engine", lambda config: pytest.fail("the model loaded"))
    monkeypatch.setattr("sys.argv", [*args, "--temperature", "nan"])
    with pytest.raises(SystemExit):
        cli.main()
    assert "temperature must be a finite number" in capsys.readouterr().err


def test_engine_flags_size_the_engine(tmp_path, loaded, monkeypatch):
    """--max-model-len, --max-num-seqs, --max-num-batched-tokens, --memory-fraction, --dtype,
    --disk-cache-bytes and --max-step-ms reach the engine: a prompt over the asked context limit
    is that line's error."""
    from statechat.engine.engine import LLMEngine

    made = []
    monkeypatch.setattr(cli_setup, "load_engine",
                        lambda config: made.append(config) or LLMEngine(config, loaded=loaded))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"id": "long", "messages": [{"role": "user", "content": words(1, 200)}]},
             {"id": "short", "messages": [{"role": "user", "content": "hi"}]}]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(cli.app, [
        "batch", str(src), "--output", str(out), "--model", str(EMBEDDED_MODEL), "--device", "cpu",
        "--max-tokens", "4", "--max-model-len", "128", "--max-num-seqs", "3",
        "--max-num-batched-tokens", "192", "--memory-fraction", "0.5", "--dtype", "float32",
        "--disk-cache-bytes", "1.5M", "--cache-dir", str(tmp_path / "cache"), "--max-step-ms", "50",
    ])
    assert result.exit_code == 0, result.output
    (config,) = made
    assert (config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens,
            config.memory_fraction, config.dtype, config.disk_cache_bytes, config.max_step_ms) == (
        128, 3, 192, 0.5, "float32", 3 << 19, 50.0)
    long, short = [json.loads(line) for line in out.read_text().splitlines()]
    assert long["error"]["message"].endswith(
        "; the context limit is 128; shorten the conversation"), long  # (as serve says it: it
    # did not say what to do)
    assert "error" not in short and short["usage"]["completion_tokens"] == 4


def test_an_engine_that_cannot_hold_the_asked_context_names_the_flag(tmp_path):
    """The engine's own refusal at start (a context past the model's positions) names the flag
    that asked for it, as a bad flag value does."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    result = CliRunner().invoke(cli.app, ["batch", str(src), "--model", str(EMBEDDED_MODEL),
                                          "--device", "cpu", "--max-model-len", "100000"])
    assert str(result.exception) == ("--max-model-len 100,000 exceeds the model's 8,192 positions; "
                                     "lower --max-model-len")


def on_a_full_disk(real_mkstemp):
    """tempfile.mkstemp whose file takes no bytes: its descriptor writes to /dev/full."""
    def mkstemp(*args, **kwargs):
        fd, path = real_mkstemp(*args, **kwargs)
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, fd)
        os.close(full)
        return fd, path
    return mkstemp


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_results_that_cannot_be_written_are_one_line_and_lose_nothing(tmp_path, shared_engine,
                                                                       monkeypatch, capsys):
    """A full disk (under the temporary results file) or `-o /dev/full`: one line and exit
    status 1, not a traceback (closing the file failed again); an earlier results file stays,
    and no temporary file is left."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out.write_text("an earlier run's results\n")
    args = ["statechat", "batch", str(src), "--model", str(EMBEDDED_MODEL), "--device", "cpu",
            "--no-cache", "--max-tokens", "2"]
    for target, full_disk in ((out, True), (Path("/dev/full"), False)):
        with monkeypatch.context() as m:
            if full_disk:
                m.setattr(cli_batch.tempfile, "mkstemp", on_a_full_disk(tempfile.mkstemp))
            m.setattr("sys.argv", [*args, "-o", str(target)])
            with pytest.raises(SystemExit) as exit_info:
                cli.main()
        err = capsys.readouterr().err
        assert exit_info.value.code == 1, err
        assert err.strip().splitlines()[-1] == (f"statechat: cannot write {target} "
                                                "(No space left on device)")
        assert "Traceback" not in err and "OSError" not in err
    assert out.read_text() == "an earlier run's results\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_requests_from_standard_input(tmp_path, shared_engine):
    """`batch -` reads the requests from standard input (it said "- is not a file"); `-o -`
    writes to standard output, as no -o does."""
    lines = [{"id": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
             {"id": "b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}]
    text = "\ufeff" + "".join(json.dumps(line) + "\r\n" for line in lines)
    for out in ([], ["-o", "-"]):
        result = CliRunner().invoke(cli.app, ["batch", "-", *out, "--model", str(EMBEDDED_MODEL),
                                              "--device", "cpu", "--no-cache"], input=text)
        assert result.exit_code == 0, result.output
        records = [json.loads(line) for line in result.stdout.splitlines()]
        assert [r["id"] for r in records] == ["a", "b"]
        assert all(r["usage"]["completion_tokens"] == 2 for r in records)
    assert not (tmp_path / "-").exists()
    bad = CliRunner().invoke(cli.app, ["batch", "-", "--model", str(EMBEDDED_MODEL)],
                             input=b"\xff\xfe{}")
    assert str(bad.exception) == ("standard input is not UTF-8 text (line 1, byte 0); save it "
                                  "as UTF-8")
    bad = CliRunner().invoke(cli.app, ["batch", "-", "--model", str(EMBEDDED_MODEL)],
                             input=b'{"a": 1}\r\n{"b": 2}\n\n{"c": "\xff"}\n')
    assert str(bad.exception) == ("standard input is not UTF-8 text (line 4, byte 27); save it "
                                  "as UTF-8")


def test_an_input_with_no_requests_says_so_without_loading_the_model(tmp_path, monkeypatch, capsys):
    """An empty file (or blank lines) is one line on stderr and exit status 0, and no model
    loads (it loaded the model and said nothing); -o FILE then holds no results."""
    monkeypatch.setattr(cli_setup, "load_engine", lambda config: pytest.fail("the model loaded"))
    empty, out = tmp_path / "empty.jsonl", tmp_path / "out.jsonl"
    empty.write_text("")
    out.write_text("an earlier run's results\n")
    monkeypatch.setattr("sys.argv", ["statechat", "batch", str(empty), "-o", str(out),
                                     "--model", str(EMBEDDED_MODEL), "--device", "cpu"])
    cli.main()  # (returns: exit status 0)
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == f"statechat: {empty} has no requests"
    assert captured.out == "" and out.read_text() == ""
    result = CliRunner().invoke(cli.app, ["batch", "-", "--model", str(EMBEDDED_MODEL)],
                                input="\n  \n")
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1] == "statechat: standard input has no requests"


def test_a_line_s_id_is_echoed_as_given(tmp_path, shared_engine):
    """A string or a number comes back as it was given (a list came back as the Python text
    "['list']"); another kind of id is that line's one-line error; no id is "line-N"."""
    user = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    ids = ["a", 7, 2.5, None, ["list"], {"k": 1}, True]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({**user, **({} if i is None else {"id": i})}) + "\n"
                           for i in ids))
    result = CliRunner().invoke(cli.app, ["batch", str(src), "-o", str(out), "--model",
                                          str(EMBEDDED_MODEL), "--device", "cpu", "--no-cache"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", 7, 2.5, "line-4", None, None, None]
    assert all("error" not in r for r in records[:4])
    assert [r["error"]["message"] for r in records[4:]] == [
        f'line {n}: "id" must be a string or a number, got {shown}'
        for n, shown in ((5, '["list"]'), (6, '{"k": 1}'), (7, "true"))]


def test_a_line_s_openai_fields_and_unknown_ones(tmp_path, shared_engine):
    """OpenAI's max_completion_tokens (over max_tokens), stop_token_ids and ignore_eos are
    read (they were dropped without a word); n past 16 and a non-boolean ignore_eos are the
    line's errors; fields batch does not read are named on stderr, with their lines."""
    user = {"messages": [{"role": "user", "content": words(8, 30)}]}
    lines = [{**user, "max_tokens": 9, "max_completion_tokens": 3, "max_token": 5},
             {**user, "max_tokens": 4, "ignore_eos": True, "stop_token_ids": [1, 2]},
             {**user, "n": 17}, {**user, "ignore_eos": "no"}, {**user, "max_token": 1, "x": 2}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(map(json.dumps, lines)) + "\n")
    result = CliRunner().invoke(cli.app, ["batch", str(src), "-o", str(out), "--model",
                                          str(EMBEDDED_MODEL), "--device", "cpu", "--no-cache"])
    assert result.exit_code == 0, result.output
    newest, eos, n, flag, typo = [json.loads(line) for line in out.read_text().splitlines()]
    assert newest["usage"]["completion_tokens"] <= 3
    assert eos["usage"]["completion_tokens"] <= 4 and "error" not in eos
    assert n["error"]["message"] == "n must be an integer from 1 to 16, got 17"
    assert flag["error"]["message"] == 'ignore_eos must be true or false, got "no"'
    assert "error" not in typo
    assert ('statechat: fields batch does not read were ignored: "max_token" (lines 1, 5); '
            '"x" (line 5)') in result.stderr


def test_a_line_that_scores_its_prompt_is_left_out_of_its_group_s_warm_up():
    """A line asking for prompt_logprobs computes its whole prompt, so it reuses no shared
    prefix: it neither joins a group's warm-up nor reports one (it showed a shared_prefix it
    had not used)."""
    from statechat.batch import warmup_prefixes
    from statechat.batch_lines import Job
    from statechat.engine.sampling import SamplingParams

    prompt = list(range(3, 200))
    jobs = [Job(n, f"j{n}", prompt_ids=prompt + [n], params=SamplingParams(**scored))
            for n, scored in enumerate([{}, {}, {"prompt_logprobs": 1}])]
    assert [members for _, members in warmup_prefixes(jobs, 64)] == [[0, 1]]
    jobs[1].params = SamplingParams(prompt_logprobs=0)
    assert warmup_prefixes(jobs, 64) == []  # (one left: no group)


def test_a_line_s_messages_are_taken_as_the_server_takes_them(tmp_path, shared_engine):
    """OpenAI's message shapes that the server takes (a "developer" message, a content of text
    parts, an assistant's null content) and "n": null give the reply of the plain line (they
    were line errors)."""
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
             {"role": "assistant", "content": ""}, {"role": "user", "content": "again"}]
    openai = [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
              {"role": "user", "content": [{"type": "text", "text": "hi "},
                                           {"type": "text", "text": "there"}]},
              {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]
    lines = [{"messages": plain}, {"messages": openai, "n": None},
             {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({**line, "max_tokens": 4}) + "\n" for line in lines))
    result = CliRunner().invoke(cli.app, ["batch", str(src), "-o", str(out), "--model",
                                          str(EMBEDDED_MODEL), "--device", "cpu", "--no-cache"])
    assert result.exit_code == 0, result.output
    first, second, image = [json.loads(line) for line in out.read_text().splitlines()]
    assert "error" not in second and second["text"] == first["text"]
    assert second["usage"] == first["usage"]
    assert image["error"]["message"] == ("messages[0].content must be a string or a list of text "
                                         "parts")


def test_a_line_asks_for_logprobs_in_openai_s_chat_form(tmp_path, shared_engine):
    """"logprobs": true with "top_logprobs": k (OpenAI's chat form) gives what "logprobs": k
    gives, and "logprobs": false none (the first was a line error, top_logprobs ignored)."""
    user = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    lines = [{**user, "logprobs": 2}, {**user, "logprobs": True, "top_logprobs": 2},
             {**user, "logprobs": True}, {**user, "logprobs": False, "top_logprobs": 0},
             {**user, "top_logprobs": 2}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(cli.app, ["batch", str(src), "-o", str(out), "--model",
                                          str(EMBEDDED_MODEL), "--device", "cpu", "--no-cache"])
    assert result.exit_code == 0, result.output
    count, chat, chat0, off, alone = [json.loads(line) for line in out.read_text().splitlines()]
    assert chat["logprobs"] == count["logprobs"] and len(chat["logprobs"]) == 3
    assert all(e["top_logprobs"] == [] for e in chat0["logprobs"])
    assert "logprobs" not in off and "error" not in off
    assert alone["error"]["message"].startswith('top_logprobs needs "logprobs": true')
    assert "ignored" not in result.stderr


def test_a_line_of_openai_s_batch_format_is_its_body(tmp_path, shared_engine):
    """A line of OpenAI's batch file format (vLLM's run-batch reads it) runs its body, with its
    custom_id as the id (every such line failed: "messages must be a non-empty list"); another
    url, or a method other than POST (it ran), is that line's error, named by its custom_id
    (its error record's id was null)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    lines = [{"id": "own", **body},
             {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": body},
             {"custom_id": "req-2", "method": "POST", "url": "/v1/embeddings", "body": body},
             {"custom_id": "req-3", "method": "GET", "url": "/v1/chat/completions", "body": body}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(cli.app, ["batch", str(src), "-o", str(out), "--model",
                                          str(EMBEDDED_MODEL), "--device", "cpu", "--no-cache"])
    assert result.exit_code == 0, result.output
    own, wrapped, other, got = [json.loads(line) for line in out.read_text().splitlines()]
    assert wrapped["id"] == "req-1" and wrapped["text"] == own["text"]
    assert wrapped["usage"]["completion_tokens"] == 3
    assert other["error"]["message"] == ('line 3: "url" must be "/v1/chat/completions" (batch '
                                         'runs chat requests), got "/v1/embeddings"')
    assert other["id"] == "req-2" and other["line"] == 3
    assert got["error"]["message"] == ('line 4: "method" must be "POST" (batch runs chat '
                                       'requests), got "GET"') and got["id"] == "req-3"
    assert "ignored" not in result.stderr  # (every such line names a model: the loaded one
    # answers, as in serve, without a warning on every run)


def test_a_bad_output_is_the_one_error_before_the_flags_and_fields_are_read(
        tmp_path, monkeypatch, capsys):
    """`-o FOLDER` with a bad flag and an unknown field says only what is wrong with the output:
    fixing it does not meet the next error after a model config was read."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}], "max_token": 3}\n')
    monkeypatch.setattr(cli_setup, "load_engine", lambda config: pytest.fail("the model loaded"))
    monkeypatch.setattr("sys.argv", ["statechat", "batch", str(src), "--model", str(EMBEDDED_MODEL),
                                     "--temperature", "-1", "-o", str(tmp_path)])
    with pytest.raises(SystemExit):
        cli.main()
    err = capsys.readouterr().err.strip()
    assert "is a folder" in err and "\n" not in err


def test_a_completions_line_is_told_that_batch_runs_chat_requests():
    """A line with "prompt" and no "messages" says why it cannot run (it read "messages must be
    a non-empty array", naming a field the line never had)."""
    from statechat.batch_lines import DEFAULT_SAMPLING, BatchDefaults, parse_line

    job = parse_line('{"id": "c", "prompt": "Once upon a time"}', 3,
                     BatchDefaults(DEFAULT_SAMPLING, None))
    assert job.error == ('batch runs chat requests: give "messages", not "prompt" '
                         "(the completions form)")


@pytest.mark.parametrize("fields, says", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be from 0 to 20, got 21"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs must be from 0 to 20, got -1"),
    ({"max_completion_tokens": -1}, "max_completion_tokens must be >= 0, got -1"),
    ({"max_completion_tokens": 1.5}, "max_completion_tokens must be an integer, got 1.5"),
    ({"max_tokens": -1}, "max_tokens must be >= 0, got -1"),
    ({"logprobs": 21}, "logprobs must be from 0 to 20, got 21"),
])
def test_a_bad_value_is_named_by_the_field_the_line_gave(fields, says):
    """A line's bad top_logprobs or max_completion_tokens is named as such (its error named
    "logprobs" and "max_tokens", which the line never had: the fields batch reads them as)."""
    from statechat.batch_lines import DEFAULT_SAMPLING, BatchDefaults, parse_line

    line = json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields})
    assert parse_line(line, 1, BatchDefaults(DEFAULT_SAMPLING, None)).error == says


def test_a_line_separator_inside_a_json_string_does_not_split_the_line(tmp_path, shared_engine):
    """U+2028, U+2029 and U+0085 may stand unescaped in a JSON string (json.dumps with
    ensure_ascii=False writes them so): such a line is one request (it was cut there into
    three lines of bad JSON, and the lines after it were numbered wrong)."""
    text = "para\u2028graph\u2029next\x85line"
    lines = [{"id": "a", "messages": [{"role": "user", "content": text}], "max_tokens": 1},
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines),
                   encoding="utf-8")
    result = CliRunner().invoke(cli.app, ["batch", str(src), "-o", str(out), "--model",
                                          str(EMBEDDED_MODEL), "--device", "cpu", "--no-cache"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "line-2"]
    assert all("error" not in r for r in records)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_requests_from_a_pipe_and_an_input_that_is_no_file(tmp_path, shared_engine):
    """A named pipe (what bash's `batch <(make_requests)` passes) is read as a file is (it was
    refused as "not a file"); a missing input and a folder are one line that says which."""
    import threading

    fifo = tmp_path / "requests.fifo"
    os.mkfifo(fifo)
    line = {"id": "p", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    writer = threading.Thread(target=lambda: fifo.write_text(json.dumps(line) + "\n"),
                              daemon=True)  # (blocked for good if the pipe is never read)
    writer.start()
    result = CliRunner().invoke(cli.app, ["batch", str(fifo), "--model", str(EMBEDDED_MODEL),
                                          "--device", "cpu", "--no-cache"])
    writer.join(timeout=10)
    assert result.exit_code == 0, result.output
    assert [json.loads(x)["id"] for x in result.stdout.splitlines()] == ["p"]
    for path, why in ((tmp_path / "missing.jsonl", "does not exist"), (tmp_path, "is a folder")):
        bad = CliRunner().invoke(cli.app, ["batch", str(path), "--model", str(EMBEDDED_MODEL)])
        assert str(bad.exception) == (f"{path} {why}; pass a JSONL file of chat requests "
                                      "('-' reads them from standard input)")


def test_a_closed_standard_output_is_one_line_before_the_model_loads(tmp_path, monkeypatch,
                                                                     capsys):
    """`statechat batch FILE >&-` (no stdout: Python's sys.stdout is None) is one line before
    the model loads (it ran every request, then ended in a traceback at the first result)."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}\n')
    monkeypatch.setattr(cli_setup, "load_engine", lambda config: pytest.fail("the model loaded"))
    for out in ([], ["-o", "-"]):
        monkeypatch.setattr("sys.argv", ["statechat", "batch", str(src), *out,
                                         "--model", str(EMBEDDED_MODEL), "--no-cache"])
        monkeypatch.setattr("sys.stdout", None)
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        monkeypatch.undo()  # (sys.stdout back, for pytest)
        monkeypatch.setattr(cli_setup, "load_engine", lambda config: pytest.fail("loaded"))
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == ("statechat: standard output is closed; pass "
                                           "--output FILE for the results\n")


@pytest.mark.parametrize("argv, says", [
    (["--min-p", "2"], "--min-p must be in [0, 1], got 2.0"),
    (["--chat-template-kwargs", "[]"], ("--chat-template-kwargs (or STATECHAT_CHAT_TEMPLATE_"
                                        "KWARGS) must be a JSON object, e.g. "
                                        "'{\"enable_thinking\": false}'")),
    (["-o", "{tmp}"], "{tmp} is a folder; pass a file name for the results"),
])
def test_a_bad_flag_is_told_before_standard_input_is_read(tmp_path, monkeypatch, capsys, argv,
                                                          says):
    """`batch -` with a bad flag or output says so at once, not once its producer has finished
    (typed at a terminal, it waited for Ctrl+D before telling a flag it had from the start)."""
    class Unread:
        def __getattr__(self, name):
            pytest.fail("standard input was read before the flags were checked")

    monkeypatch.setattr("sys.stdin", Unread())
    monkeypatch.setattr("sys.argv", ["statechat", "batch", "-", "--model", str(EMBEDDED_MODEL),
                                     *(a.replace("{tmp}", str(tmp_path)) for a in argv)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"statechat: {says.replace('{tmp}', str(tmp_path))}\n"


def test_a_group_s_time_to_first_token_counts_its_wait_for_the_warm_up(loaded, monkeypatch):
    """The members of a group are queued once its warm-up has computed their shared prefix,
    yet they were asked for with the batch: their ttft_ms counts from then, the warm-up's
    steps included (it counted from their late queueing: 47 ms for a group that waited 2.6 s
    on a GPU, against 2,678 ms for a lone request of half its prompt)."""
    import time

    from statechat.batch import run_batch
    from statechat.batch_lines import BatchDefaults, parse_lines
    from statechat.config import EngineConfig
    from statechat.engine.engine import LLMEngine
    from statechat.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu"), loaded=loaded)
    shared = words(3, 160)
    lines = [json.dumps({"id": n, "messages": [{"role": "user", "content": f"{shared} {n}"}]})
             for n in range(2)]
    jobs = parse_lines(lines, BatchDefaults(SamplingParams(max_tokens=2, ignore_eos=True)))
    step, step_s = engine.step, 0.1

    def slow_step():  # (every step takes at least step_s: the warm-up's one, then the group's)
        time.sleep(step_s)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    results = run_batch(engine, jobs, lambda record: None)
    assert all(r["cache"]["shared_prefix"]["tokens"] >= 64 for r in results), results
    assert all(r["ttft_ms"] >= 2 * step_s * 1e3 for r in results), [r["ttft_ms"] for r in results]


def test_reasoning_parser_splits_each_result(tmp_path, loaded, monkeypatch):
    """`batch --reasoning-parser qwen3` gives each result the reasoning of its reply (up to
    `</think>`, which a thinking template's prompt opened) apart from its answer ("text"), as
    the server does; a line with thinking off is all answer, and without the flag the text is
    whole."""
    from statechat.engine.engine import LLMEngine
    from tests.helpers import THINKING, force_reply, with_template

    reply, forced = "Let me see.</think>\n\nIt is 4.", []

    def load_engine(config):
        engine = LLMEngine(config, loaded=with_template(loaded, THINKING))
        forced[:] = force_reply(engine, monkeypatch, reply)
        return engine

    monkeypatch.setattr(cli_setup, "load_engine", load_engine)
    ask = {"messages": [{"role": "user", "content": "2+2?"}]}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "think", **ask}) + "\n" + json.dumps(
        {"id": "plain", **ask, "chat_template_kwargs": {"enable_thinking": False}}) + "\n"
        + json.dumps({"id": "left out", **ask, "include_reasoning": False}) + "\n"
        + json.dumps({"id": "bad", **ask, "include_reasoning": "no"}) + "\n")
    args = ["batch", str(src), "-o", str(out), "--device", "cpu", "--no-cache"]
    assert CliRunner().invoke(cli.app, [*args, "--reasoning-parser", "qwen3"]).exit_code == 0
    think, plain, left_out, bad = [json.loads(line) for line in out.read_text().splitlines()]
    assert (think["reasoning"], think["text"]) == ("Let me see.", "\n\nIt is 4.")
    # (vLLM's include_reasoning false: the answer alone; another value is the line's error)
    assert left_out["text"] == "\n\nIt is 4." and "reasoning" not in left_out
    assert "include_reasoning must be true or false" in bad["error"]["message"]
    assert (plain["reasoning"], plain["text"]) == (None, reply)
    assert think["usage"]["completion_tokens"] == len(forced)  # (the reasoning's count)
    assert CliRunner().invoke(cli.app, args).exit_code == 0
    whole = json.loads(out.read_text().splitlines()[0])
    assert whole["text"] == reply and "reasoning" not in whole


def test_a_stop_token_on_the_last_token_allowed_ends_with_stop(tmp_path, shared_engine):
    """The EOS or a stop token sampled as the max_tokens-th token ends the reply with "stop"
    (and its stop_reason), as the engine and the server report it, not "length"; the other
    EOS id of generation_config.json (<|endoftext|>, 0) is named as a stop token."""
    user = {"messages": [{"role": "user", "content": words(9, 10)}], "max_tokens": 1}
    lines = [{"id": "eos", **user, "logit_bias": {"2": 100}},
             {"id": "other", **user, "logit_bias": {"0": 100}},
             {"id": "stop", **user, "logit_bias": {"40": 100}, "stop_token_ids": [40]},
             {"id": "cut", **user, "logit_bias": {"40": 100}}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(map(json.dumps, lines)) + "\n")
    args = ["batch", str(src), "-o", str(out), "--model", str(EMBEDDED_MODEL), "--device", "cpu",
            "--no-cache"]
    assert CliRunner().invoke(cli.app, args).exit_code == 0
    got = {r["id"]: (r["finish_reason"], r["stop_reason"], r["text"])
           for r in map(json.loads, out.read_text().splitlines())}
    assert got["eos"] == ("stop", None, "") and got["other"] == ("stop", 0, "")
    assert got["stop"] == ("stop", 40, "") and got["cut"][:2] == ("length", None)
    assert got["cut"][2]  # (token 40 has text: kept where it is no stop)
