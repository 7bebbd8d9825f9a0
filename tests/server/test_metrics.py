"""`GET /metrics`, scraped as Prometheus scrapes vLLM's: its counters are the sums of what the
responses' `usage` reported, counted before a client can have read its answer (a repeated
prompt's cached tokens, a reply cut by length, a stream its client left counted as aborted),
its text parses as the exposition format 0.0.4 (HELP and TYPE for each metric, cumulative
histogram buckets), its gauges show the engine's pools and the disk tier, it is served without
the API key, and HEAD gives its headers alone."""

from __future__ import annotations

import http.client
import json
import math
import re
import socket
import time
import urllib.request

import pytest
import torch

from statechat.api_answer import AnswerHandler
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL
from tests.server.conftest import steps_held_until_an_abort
from tests.serving import KEY, post, serving_engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE = re.compile(rf'^({NAME})(?:\{{((?:{NAME}="[^"]*",?)*)\}})? (\S+)$')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    loaded = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    engine = LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu", max_model_len=1024,
                                    cache_dir=tmp_path_factory.mktemp("cache")), loaded=loaded)
    with serving_engine(engine, warm_next_turn=False) as srv:
        yield srv


def parse(text: str) -> tuple[dict[tuple[str, tuple], float], dict[str, str]]:
    """The exposition's samples {(name, ((label, value), ...)): value} and each metric's TYPE;
    an AssertionError where a line breaks the format or a sample has no HELP and TYPE before
    it."""
    samples, types, helps = {}, {}, set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            assert re.fullmatch(NAME, name) and help_text and name not in helps, line
            helps.add(name)
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in types, line
            types[name] = kind
        else:
            match = SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name, labels, value = match.groups()
            family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
            assert family in types and family in helps, f"no HELP or TYPE before {line!r}"
            pairs = tuple(re.findall(rf'({NAME})="([^"]*)"', labels or ""))
            samples[name, pairs] = float(value)
    assert text.endswith("\n")
    return samples, types


def scrape(server) -> tuple[dict, dict]:
    """GET /metrics without the API key (the server has one): its parsed samples and types."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == CONTENT_TYPE
        return parse(resp.read().decode())


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(labels.items())), 0.0)


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def ask(content: str, **fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0,
            **fields}


def test_counters_are_the_sums_of_the_usage_reported(server):
    before, _ = scrape(server)
    prompt = "tell me about the state cache " * 30  # (some full blocks: a repeat reuses them)
    replies = [post(server, ask(prompt, max_tokens=6)), post(server, ask(prompt, max_tokens=6)),
               post(server, ask("count to ten", max_tokens=2, ignore_eos=True))]
    stream = post(server, ask("a streamed one", max_tokens=3, stream=True,
                              stream_options={"include_usage": True}))
    usages = [r["usage"] for r in replies] + [stream[-1]["usage"]]
    reasons = [r["choices"][0]["finish_reason"] for r in replies]
    reasons += [c["choices"][0]["finish_reason"] for c in stream if c["choices"]][-1:]
    assert replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert reasons[2] == "length"
    after, types = scrape(server)
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert delta(before, after, "statechat_prompt_tokens_total") == prompt_tokens
    assert delta(before, after, "statechat_prompt_tokens_cached_total") == cached
    assert delta(before, after, "statechat_prompt_tokens_computed_total") == prompt_tokens - cached
    assert delta(before, after, "statechat_generation_tokens_total") == sum(
        u["completion_tokens"] for u in usages)
    by_tier = sum(delta(before, after, "statechat_prompt_tokens_cached_by_tier_total", tier=t)
                  for t in ("device", "host", "disk"))
    assert by_tier == cached
    for reason in ("stop", "length"):
        assert delta(before, after, "statechat_requests_finished_total",
                     reason=reason) == reasons.count(reason)
    for hist in ("statechat_time_to_first_token_seconds", "statechat_request_seconds"):
        assert types[hist] == "histogram"
        assert delta(before, after, f"{hist}_count") == 4
        assert delta(before, after, f"{hist}_bucket", le="+Inf") == 4
    assert 0 < delta(before, after, "statechat_time_to_first_token_seconds_sum") <= delta(
        before, after, "statechat_request_seconds_sum")
    assert types["statechat_prompt_tokens_total"] == "counter"


def test_an_answer_read_is_counted_at_once(server, monkeypatch):
    """(It was counted after the answer was sent, so a scrape right after could miss it.)"""
    log_ended = AnswerHandler._log_ended

    def slow_after_the_answer(self, *args):
        time.sleep(0.5)
        log_ended(self, *args)

    monkeypatch.setattr(AnswerHandler, "_log_ended", slow_after_the_answer)
    for stream in (False, True):
        before, _ = scrape(server)
        post(server, ask("counted at once", max_tokens=2, stream=stream))
        after, _ = scrape(server)
        assert delta(before, after, "statechat_time_to_first_token_seconds_count") == 1


def test_a_stream_its_client_left_counts_as_aborted(server, monkeypatch):
    before, _ = scrape(server)
    body = ask("left behind", max_tokens=50, stream=True)
    tokens = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"{server.url}/tokenize", data=json.dumps({"messages": body["messages"]}).encode(),
        headers={"Authorization": f"Bearer {KEY}"}), timeout=10).read())["count"]
    aborted = steps_held_until_an_abort(server, monkeypatch)
    data = json.dumps(body).encode()
    with socket.create_connection(server.server_address[:2], timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        got = b""
        while b"data: " not in got:  # (the headers, then the role's chunk: the client goes)
            chunk = sock.recv(4096)
            assert chunk, "the server closed the stream"
            got += chunk
    assert aborted.wait(10)
    deadline = time.monotonic() + 10
    while (after := scrape(server)[0]) and not delta(
            before, after, "statechat_requests_finished_total", reason="abort"):
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.05)
    assert delta(before, after, "statechat_requests_finished_total", reason="abort") == 1
    assert delta(before, after, "statechat_prompt_tokens_total") == tokens


def test_gauges_show_the_pools_and_the_disk_tier(server):
    saved = value(scrape(server)[0], "statechat_checkpoints_saved_total")
    post(server, ask("fill a checkpoint " * 40, max_tokens=2))
    # (the cache writer saves it after the answer, then sums the disk's bytes: waited for)
    server.worker.engine.store.flush()
    samples = scrape(server)[0]
    assert value(samples, "statechat_checkpoints_saved_total") > saved
    assert value(samples, "statechat_requests_running") == 0
    assert value(samples, "statechat_requests_waiting") == 0
    for used, total in [("statechat_kv_blocks_used", "statechat_kv_blocks_total"),
                        ("statechat_gdn_slots_used", "statechat_gdn_slots_total"),
                        ("statechat_disk_cache_bytes", "statechat_disk_cache_budget_bytes")]:
        assert 0 <= value(samples, used) <= value(samples, total) and value(samples, total) > 0
    assert value(samples, "statechat_disk_cache_bytes") > 0
    assert value(samples, "statechat_kv_blocks_cached") > 0
    buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in samples.items()
                     if name == "statechat_request_seconds_bucket")
    assert buckets[-1][0] == math.inf and [v for _, v in buckets] == sorted(
        v for _, v in buckets)


def test_head_and_methods(server):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.request("GET", "/metrics")
    got = conn.getresponse()
    length = int(got.headers["Content-Length"])
    assert len(got.read()) == length
    conn.request("HEAD", "/metrics")
    head = conn.getresponse()
    assert head.status == 200 and head.headers["Content-Type"] == CONTENT_TYPE
    assert int(head.headers["Content-Length"]) > 0 and head.read() == b""
    conn.request("POST", "/metrics", "{}", {"Authorization": f"Bearer {KEY}"})
    refused = conn.getresponse()
    assert refused.status == 405 and refused.headers["Allow"] == "GET, HEAD"
    assert "/metrics" in json.loads(refused.read())["error"]["message"]
    conn.close()
