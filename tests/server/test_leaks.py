"""A server under a few hundred mixed requests leaks nothing: chats and text completions,
streamed or not, n of 1 to 3, seeds and logprobs, refused prompts, and clients that close their
socket mid-stream or before their answer; once it is idle again (its next-turn warm-ups done too)
its engine holds its pools whole (tests.helpers.assert_idle_pools), and a second phase equal to
the first leaves no more threads, and little more Python memory or RSS, than the first did."""

from __future__ import annotations

import gc
import http.client
import json
import random
import socket
import struct
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL
from tests.helpers import assert_idle_pools
from tests.serving import KEY, serving_engine

HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
WORDS = ["state", "cache", "block", "token", "layer", "chat", "model", "prefix", "reuse", "delta",
         "gate", "kernel"]


@pytest.fixture(scope="module")
def server():
    """A server over an engine whose pools run short (preemptions, evictions)."""
    loaded = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    engine = LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu", max_model_len=512,
                                    num_kv_blocks=16, num_state_slots=10, max_num_seqs=4,
                                    max_num_batched_tokens=128), loaded=loaded)
    with serving_engine(engine) as srv:
        yield srv


def random_request(rng: random.Random) -> tuple[str, dict, str]:
    """(path, body, how the client reads it: 'all' or 'leave' mid-stream or 'drop' at once)."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 40, 120, 900])))
    body: dict = {"model": "tiny", "max_tokens": rng.choice([1, 8, 30]),
                  "n": rng.choice([1, 1, 2, 3]), "stream": rng.random() < 0.5}
    if rng.random() < 0.3:
        body.update(temperature=1.0, seed=rng.randrange(1000))
    if rng.random() < 0.2:
        body["logprobs"] = True if rng.random() < 0.5 else 2
    if rng.random() < 0.5:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": text}]
        if body.get("logprobs") is not None:
            body["logprobs"], body["top_logprobs"] = True, 2
    else:
        path = "/v1/completions"
        body["prompt"] = text
        if body.pop("logprobs", None) is not None:
            body["logprobs"] = 2
    how = rng.choice(["all", "all", "leave", "drop"])
    return path, body, how


def send(server, request: tuple[str, dict, str]) -> int:
    """Make the request and read it as asked; the status (0 for a client that left)."""
    path, body, how = request
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=120)
    try:
        if how == "drop":  # the request sent, the socket reset before any answer
            conn.connect()
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.request("POST", path, json.dumps(body), HEADERS)
        if how == "drop":
            time.sleep(0.05)
            return 0
        resp = conn.getresponse()
        if how == "leave" and body["stream"] and resp.status == 200:
            resp.readline()  # (the first event)
            return 0
        resp.read()
        return resp.status
    finally:
        conn.close()


def settle(server, timeout: float = 60.0) -> None:
    """Wait until the server's engine has been idle a moment (warm-ups of next turns done)."""
    worker, deadline, quiet_since = server.worker, time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        idle = worker.idle() and not worker.engine.has_unfinished()
        turns = server.next_turns
        idle = idle and (turns is None or turns._latest is None)
        if not idle:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > 0.5:
            return
        time.sleep(0.05)
    raise AssertionError("the server's engine never went idle")


def phase(server, seed: int, num_requests: int) -> list[int]:
    rng = random.Random(seed)
    requests = [random_request(rng) for _ in range(num_requests)]
    with ThreadPoolExecutor(6) as pool:
        statuses = list(pool.map(lambda r: send(server, r), requests))
    settle(server)
    return statuses


def threads_after(before: int, timeout: float = 10.0) -> int:
    """The thread count once connection threads have ended (or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    return threading.active_count()


def live_objects() -> int:
    """How many objects the garbage collector tracks, after a collection."""
    gc.collect()
    return len(gc.get_objects())


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_mixed_requests_and_disconnects_leak_nothing(server):
    statuses = phase(server, 0, 30)  # warm: first-use caches, the warm-up thread
    assert_idle_pools(server.worker.engine)
    assert {200, 0} <= set(statuses), statuses
    threads = threads_after(0)
    tracemalloc.start()
    try:
        first = phase(server, 1, 60)
        threads1 = threads_after(threads)
        snap1, rss1 = tracemalloc.take_snapshot(), rss_kib()
        objects1 = live_objects()  # (both counts with snap1's objects)
        second = phase(server, 1, 60)
        threads2, objects2 = threads_after(threads), live_objects()
        snap2, rss2 = tracemalloc.take_snapshot(), rss_kib()
    finally:
        tracemalloc.stop()
    assert first == second
    assert_idle_pools(server.worker.engine)
    assert threads1 <= threads and threads2 <= threads, (threads, threads1, threads2)
    grew = [s for s in snap2.compare_to(snap1, "lineno") if s.size_diff > 0]
    assert sum(s.size_diff for s in grew) < 256 << 10, [str(s) for s in grew[:10]]
    assert objects2 - objects1 < 200, (objects1, objects2)
    assert rss2 - rss1 < 32 << 10, (rss1, rss2)
