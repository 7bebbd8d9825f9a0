"""A served tiny model for each test module: a ChatServer on loopback (port 0, an API key) over
one EngineWorker, and an openai client of it."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL
from tests.serving import KEY, serving_engine


@pytest.fixture(scope="module")
def server():
    loaded = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    engine = LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu", max_model_len=1024),
                       loaded=loaded)
    with serving_engine(engine, "tiny-qwen3.5") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def steps_held_until_an_abort(server, monkeypatch) -> threading.Event:
    """Hold the engine's steps (as a long prompt's chunks give a stream no event) until the
    worker aborts a request; the event that says it did (set it to let the steps go)."""
    engine, worker, aborted = server.worker.engine, server.worker, threading.Event()
    step, abort = engine.step, worker.abort

    def held_step():
        assert aborted.wait(30), "no request was aborted"
        return step()

    def spied_abort(handle) -> None:
        abort(handle)
        aborted.set()

    monkeypatch.setattr(engine, "step", held_step)
    monkeypatch.setattr(worker, "abort", spied_abort)
    return aborted


def left_and_aborted(server, monkeypatch, path: str, body: dict, headers: dict,
                     check: Callable[[http.client.HTTPResponse], None] | None = None) -> None:
    """POST `body` to `path` with the engine's steps held (steps_held_until_an_abort), let
    `check` look at the answer's start (None: read nothing of it), go away, and require that
    the server aborts the request within 10 s."""
    aborted = steps_held_until_an_abort(server, monkeypatch)
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **headers})
    if check is not None:
        resp = conn.getresponse()
        check(resp)
        resp.close()
    conn.close()
    try:
        assert aborted.wait(10)
    finally:
        aborted.set()
