"""`statechat batch ... | head -1`: when the reader of standard output goes away, the batch
ends quietly, as `cat` and `grep` do (no error line, no traceback, exit status 141, SIGPIPE's
as a shell reports it), and computes nothing more: it said `cannot write stdout (Broken pipe)`
and exit status 1."""

from __future__ import annotations

import json

from statechat.engine.engine import LLMEngine
from statechat.paths import EMBEDDED_MODEL
from tests.cli.test_broken_pipe import run_into_closed_pipe

HI = [{"role": "user", "content": "hi"}]


def run(monkeypatch, src) -> int:
    """The batch's exit status, its standard output a pipe whose reader has gone (what `| head
    -1` leaves)."""
    return run_into_closed_pipe(monkeypatch, ["batch", str(src), "--model", str(EMBEDDED_MODEL),
                                              "--device", "cpu", "--no-cache"])


def test_a_gone_reader_ends_the_batch_quietly_and_at_once(tmp_path, shared_engine, monkeypatch,
                                                         capsys):
    src = tmp_path / "in.jsonl"
    lines = [{"id": 0, "messages": HI, "max_tokens": 1}]  # (done first, then written)
    lines += [{"id": i, "messages": HI, "max_tokens": 400, "ignore_eos": True}
              for i in range(1, 4)]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    steps = []
    step = LLMEngine.step
    monkeypatch.setattr(LLMEngine, "step", lambda self: steps.append(1) or step(self))
    assert run(monkeypatch, src) == 141
    err = capsys.readouterr().err
    assert "cannot write" not in err and "Broken pipe" not in err and "Traceback" not in err
    assert "requests failed" not in err
    assert len(steps) < 20  # (it went on with the other lines' 400 tokens)


def test_a_gone_reader_of_error_records_alone_ends_quietly(tmp_path, monkeypatch, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("{not json\n")
    assert run(monkeypatch, src) == 141
    err = capsys.readouterr().err
    assert "Broken pipe" not in err and "requests failed" not in err
