"""EngineWorker's request handles, as the server waits on them: result(timeout) gives up with
TimeoutError while the request runs and returns its output once it ends (and at once on every
later call, as an iteration after it ends at once); a request that failed raises its error on
every call; on_end is called as a request ends, before its end can be read; `started` is set by
the first event, by a failure and by an abort; a request's time to first token counts from its
submission, also when the worker was inside a step; a long prompt's tokenization (seconds for
megabytes) holds up no short prompt's, and gives the same ids; a request submitted without
params samples with the engine's default_params (the checkpoint's recommended sampling), as
LLMEngine's own requests do; warm_structured builds the structured outputs' tokenizer view once,
ahead of the first such request (a failure there one line in the log)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.engine.worker import EngineWorker
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL


@pytest.fixture(scope="module")
def worker():
    loaded = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    w = EngineWorker(LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu"), loaded=loaded))
    yield w
    w.shutdown()


def test_result_with_a_timeout(worker):
    handle = worker.submit(list(range(3, 40)), SamplingParams(max_tokens=400, ignore_eos=True))
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.001)
    out = handle.result(timeout=60)
    assert handle.started.is_set() and len(out.token_ids) == 400
    assert handle.result(timeout=0) is out and list(handle) == []


def test_a_request_without_params_samples_with_the_engine_s_defaults(worker, monkeypatch):
    """(It sampled greedily with SamplingParams(), 256 tokens, whatever the checkpoint's
    generation_config.json recommends.)"""
    defaults = SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True)
    monkeypatch.setattr(worker.engine, "default_params", defaults)
    handle = worker.submit(list(range(3, 40)))
    assert handle.params is defaults and len(handle.result(timeout=60).token_ids) == 3


def test_a_failed_request_raises_on_every_call(worker, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("boom at add")

    monkeypatch.setattr(worker.engine, "add_checked", fail)
    handle = worker.submit(list(range(3, 40)), SamplingParams(max_tokens=4))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="boom at add"):
            handle.result(timeout=60)
    assert handle.started.is_set()


def test_an_aborted_request_is_started_and_ends(worker):
    handle = worker.submit(list(range(3, 40)), SamplingParams(max_tokens=100_000, ignore_eos=True))
    handle.abort()
    assert handle.result(timeout=60).finish_reason == "abort" and handle.started.is_set()


def test_on_end_is_called_once_before_the_end_can_be_read(worker, monkeypatch):
    """(The server counts each choice for /metrics this way: a client that read its answer
    finds it counted.) A failed request's on_end gets None; one whose on_end raises still
    ends, and the worker goes on."""
    calls = []

    def on_end(out, latency_s):
        calls.append((out, latency_s))

    done = worker.submit(list(range(3, 40)), SamplingParams(max_tokens=3), on_end=on_end)
    out = done.result(timeout=60)
    assert calls == [(out, done.latency_s)] and done.latency_s > 0
    aborted = worker.submit(list(range(3, 40)), SamplingParams(max_tokens=100_000,
                                                               ignore_eos=True), on_end=on_end)
    aborted.abort()
    assert aborted.result(timeout=60).finish_reason == "abort" and calls[-1][0] is aborted.output

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    raising = worker.submit(list(range(3, 40)), SamplingParams(max_tokens=2), on_end=boom)
    assert len(raising.result(timeout=60).token_ids) == 2
    with monkeypatch.context() as m:
        m.setattr(worker.engine, "add_checked", boom)
        failed = worker.submit(list(range(3, 40)), SamplingParams(max_tokens=2), on_end=on_end)
        with pytest.raises(RuntimeError, match="boom"):
            failed.result(timeout=60)
    assert len(calls) == 3 and calls[-1][0] is None
    assert len(worker.submit(list(range(3, 9)), SamplingParams(max_tokens=2)).result(
        timeout=60).token_ids) == 2


def test_a_request_submitted_as_the_worker_stops_is_refused_not_left_unanswered():
    """A shutdown that comes while a request is being checked: the request is refused with
    one line (it was queued after the stop, and its caller waited for ever)."""
    from statechat.errors import ShuttingDownError

    engine = LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu"),
                       loaded=load_model(EMBEDDED_MODEL, dtype=torch.float32))
    w = EngineWorker(engine)
    check = engine.check_prompt

    def check_then_stop(prompt):
        checked = check(prompt)
        w.shutdown()  # (another thread's, in the real race)
        return checked

    engine.check_prompt = check_then_stop
    with pytest.raises(ShuttingDownError, match="the engine is shutting down"):
        w.submit(list(range(3, 40)), SamplingParams(max_tokens=4))


def test_a_speculative_request_yields_to_the_next_one():
    """Work done ahead (a next turn's prefix) is aborted as soon as another request is added,
    so that it never delays a request nor computes its prefix twice; a speculative request
    does not make another speculative one yield."""
    loaded = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    worker = EngineWorker(LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu",
                                                 max_num_batched_tokens=64), loaded=loaded))
    none = SamplingParams(max_tokens=0)
    ahead = worker.submit([3 + i % 300 for i in range(2000)], none, speculative=True)
    also = worker.submit([5 + i % 300 for i in range(2000)], none, speculative=True)
    real = worker.submit(list(range(3, 40)), SamplingParams(max_tokens=2, ignore_eos=True))
    assert real.result(timeout=60).finish_reason == "length"
    assert ahead.result(timeout=60).finish_reason == "abort"
    assert also.result(timeout=60).finish_reason == "abort"
    assert ahead.seq.speculative and not real.seq.speculative  # (its steps keep to the target)
    assert worker.idle()
    worker.shutdown()


def test_a_finished_request_s_abort_queues_nothing(worker):
    handle = worker.submit(list(range(3, 40)), SamplingParams(max_tokens=2, ignore_eos=True))
    handle.result(timeout=60)
    handle.abort()
    assert worker.idle()


def test_time_to_first_token_counts_from_the_submission(worker, monkeypatch):
    """(It once counted from when the worker took the request up after the step under way: a
    request that came during a long prefill reported a few ms for a wait of seconds.)"""
    release, step = threading.Event(), worker.engine.step

    def held_step():
        release.wait()
        return step()

    monkeypatch.setattr(worker.engine, "step", held_step)
    first = worker.submit(list(range(3, 40)), SamplingParams(max_tokens=2))
    time.sleep(0.2)  # (the worker is inside its first step)
    second = worker.submit([5, 6, 7], SamplingParams(max_tokens=2))
    time.sleep(1.0)
    release.set()
    first.result(timeout=60)
    assert second.result(timeout=60).ttft_s >= 1.0


def test_a_long_prompt_being_tokenized_holds_up_no_short_one(worker, monkeypatch):
    """(One lock held every request's tokenization behind a 3 MB prompt's 2.4 s, 30 MB's a
    minute.) The long prompt's encoding is held here until the short one is done."""
    from statechat.chat import template
    from statechat.engine.worker import LONG_TEXT_CHARS

    render, entered, release = template.render, threading.Event(), threading.Event()

    def held_render(tokenizer, messages, *args):
        if len(messages[0]["content"]) > LONG_TEXT_CHARS:
            entered.set()
            assert release.wait(30)
        return render(tokenizer, messages, *args)

    monkeypatch.setattr(template, "render", held_render)
    long_text = "state cache " * (LONG_TEXT_CHARS // 10)
    got = {}
    long = threading.Thread(target=lambda: got.update(long=worker.render(
        [{"role": "user", "content": long_text}])))
    long.start()
    try:
        assert entered.wait(30)
        short = threading.Thread(target=lambda: got.update(short=worker.render(
            [{"role": "user", "content": "hi"}])))
        short.start()
        short.join(10)
        assert "short" in got, "the short prompt waited for the long one"
    finally:
        release.set()
        long.join(30)
    tokenizer = worker.engine.tokenizer
    assert got["long"] == render(tokenizer, [{"role": "user", "content": long_text}])
    assert got["short"] == render(tokenizer, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("extra", ["tools", "template_kwargs"])
def test_a_prompt_long_by_its_tools_is_tokenized_in_the_long_lane(worker, extra):
    """The rendered text is long by the tools (or template variables) rendered with short
    messages too: a request with megabytes of tool schemas took the short lane, holding up
    every other request's tokenization. Here a short one's holds the short lane meanwhile."""
    from statechat.engine.worker import LONG_TEXT_CHARS

    long_text = "state cache " * (LONG_TEXT_CHARS // 10)
    given = {"tools": [{"type": "function", "function": {"name": "f", "description": long_text}}]}
    if extra == "template_kwargs":
        given = {"template_kwargs": {"notes": long_text}}
    got = {}
    rendering = threading.Thread(target=lambda: got.update(ids=worker.render(
        [{"role": "user", "content": "hi"}], **given)))
    with worker.tokenizer_lock:  # (a short prompt being tokenized)
        rendering.start()
        rendering.join(10)
        assert "ids" in got, "the long render waited in the short lane"


def test_warm_structured_builds_the_tokenizer_view_once_ahead(worker, monkeypatch):
    """(`statechat serve` calls it at its start: its first structured request then waits for
    no build, about a second at 250k tokens, while holding the tokenizer.)"""
    from statechat.engine import structured

    grammars, builds = worker.engine.runner.grammars, []
    hf = structured._llguidance().hf
    build = hf.from_tokenizer

    def counted(*args, **kwargs):
        builds.append(1)
        return build(*args, **kwargs)

    monkeypatch.setattr(hf, "from_tokenizer", counted)
    monkeypatch.setattr(grammars, "_ll_tokenizer", None)
    worker.warm_structured().join(60)
    params = SamplingParams(max_tokens=4, structured=structured.StructuredOutput(regex="[ab]+"))
    assert worker.submit(list(range(3, 40)), params).result(timeout=60).token_ids
    assert builds == [1]


def test_a_failed_warm_up_is_one_line_in_the_log_not_a_traceback(worker, monkeypatch, caplog):
    """(`statechat serve` warms at its start: a tokenizer llguidance cannot take printed a
    thread's traceback there, though no request had asked for a structured output.)"""
    from statechat.engine import structured

    def broken(*args, **kwargs):
        raise ValueError("this tokenizer cannot be read\nsecond line")

    uncaught = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    monkeypatch.setattr(structured._llguidance().hf, "from_tokenizer", broken)
    monkeypatch.setattr(worker.engine.runner.grammars, "_ll_tokenizer", None)
    worker.warm_structured().join(60)
    assert uncaught == []
    (said,) = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert "\n" not in said
