"""`statechat batch -o FILE` stopped early (Ctrl+C, SIGTERM) keeps the results that finished
before it in FILE.partial and says so in one line, leaving an earlier FILE as it was (the
finished results were deleted with the temporary file)."""

from __future__ import annotations

import json
import signal

import pytest

from statechat import cli
from statechat.paths import EMBEDDED_MODEL


def stop_after(monkeypatch, records: int, stop) -> None:
    """Make the batch call stop() once it has written `records` results."""
    write, written = cli.write_records, []

    def write_then_stop(sink, output, recs):
        write(sink, output, recs)
        written.extend(recs)
        if len(written) == records:
            stop()

    monkeypatch.setattr(cli, "write_records", write_then_stop)


def ctrl_c():
    raise KeyboardInterrupt


def sigterm():
    handler = signal.getsignal(signal.SIGTERM)  # (called, not sent: no handler must not end pytest)
    if not callable(handler):
        pytest.fail("SIGTERM would end the batch and lose its finished results")
    handler(signal.SIGTERM, None)


@pytest.mark.parametrize(("stop", "code"), [(ctrl_c, 130), (sigterm, 143)])
def test_a_stopped_batch_keeps_its_finished_results(tmp_path, shared_engine, monkeypatch, capsys,
                                                    stop, code):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 2 + 3 * i}) + "\n" for i in range(4)))
    out.write_text("an earlier run's results\n")
    (tmp_path / "out.jsonl.partial").write_text("an earlier stop's results\n")
    stop_after(monkeypatch, 2, stop)
    monkeypatch.setattr("sys.argv", ["statechat", "batch", str(src), "-o", str(out), "--model",
                                     str(EMBEDDED_MODEL), "--device", "cpu", "--no-cache"])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == code
    assert signal.getsignal(signal.SIGTERM) == before  # (the batch's handler is gone)
    kept = tmp_path / "out.jsonl.partial.2"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"statechat: interrupted; the first 2 results (input order) are in {kept}; {out} is "
        "left as it was")
    assert [json.loads(line)["id"] for line in kept.read_text().splitlines()] == [0, 1]
    assert out.read_text() == "an earlier run's results\n"
    assert (tmp_path / "out.jsonl.partial").read_text() == "an earlier stop's results\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in.jsonl", "out.jsonl", "out.jsonl.partial", "out.jsonl.partial.2"]  # no temp left


def test_sigterm_with_results_on_standard_output_exits_143(tmp_path, shared_engine,
                                                            monkeypatch):
    """(To standard output there is no file to keep: the exit status still says SIGTERM; it
    said 130, Ctrl+C's.)"""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 2 + 3 * i}) + "\n" for i in range(4)))
    stop_after(monkeypatch, 2, sigterm)
    monkeypatch.setattr("sys.argv", ["statechat", "batch", str(src), "--model",
                                     str(EMBEDDED_MODEL), "--device", "cpu", "--no-cache"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 143


@pytest.mark.parametrize(("stop", "code"), [(ctrl_c, 130), (sigterm, 143)])
def test_a_batch_stopped_on_standard_output_says_how_many_results_it_wrote(
        tmp_path, shared_engine, monkeypatch, capsys, stop, code):
    """(It stopped without a word: the user could not tell a stop from the end of the run, nor
    where to resume, unless the progress bar was in sight.)"""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 2 + 3 * i}) + "\n" for i in range(4)))
    stop_after(monkeypatch, 2, stop)
    monkeypatch.setattr("sys.argv", ["statechat", "batch", str(src), "--model",
                                     str(EMBEDDED_MODEL), "--device", "cpu", "--no-cache"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == code
    out, err = capsys.readouterr()
    assert [json.loads(line)["id"] for line in out.splitlines()] == [0, 1]
    assert err.strip().splitlines()[-1] == ("statechat: interrupted; the first 2 results (input "
                                            "order) went to standard output")


def test_the_results_are_in_place_before_the_cache_is_flushed(tmp_path, shared_engine,
                                                              monkeypatch):
    """The engine's close, which flushes the cache's writes and may wait on a lock another
    process holds on the index (some 37 s), comes after -o FILE holds every result: FILE
    appeared only once the flush was over."""
    from statechat.engine.engine import LLMEngine

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 2}) + "\n" for i in range(3)))
    seen = []
    monkeypatch.setattr(LLMEngine, "close", lambda self: seen.append(
        out.read_text() if out.exists() else None))
    monkeypatch.setattr("sys.argv", ["statechat", "batch", str(src), "-o", str(out), "--model",
                                     str(EMBEDDED_MODEL), "--device", "cpu", "--no-cache"])
    cli.main()  # (a run with no failure returns)
    assert len(seen) == 1 and seen[0] is not None
    assert [json.loads(line)["id"] for line in seen[0].splitlines()] == [0, 1, 2]


def test_one_result_kept_is_said_in_the_singular(tmp_path):
    from statechat.cli_batch import keep_partial

    tmp, out = tmp_path / "tmp", tmp_path / "out.jsonl"
    tmp.write_text('{"id": 1}\n')
    said = keep_partial(tmp, out)
    assert said == f"the first result (input order) is in {out}.partial; {out} is left as it was"
