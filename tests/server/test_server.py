"""`statechat serve` through the official openai client on loopback: streamed and non-streamed
replies with cached_tokens, OpenAI-shaped errors for bad requests and over-long prompts, the API
key, and 8 concurrent clients all completing."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoTokenizer

from statechat.api_serve import bind
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.engine.worker import EngineWorker
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL
from statechat.server import ChatServer
from tests.server.conftest import KEY

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
WORDS = ["state", "cache", "block", "token", "layer", "chat", "model", "prefix", "reuse", "delta",
         "gate", "kernel"]


def words(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


def chat(seed: int, n: int = 120) -> list[dict]:
    return [{"role": "system", "content": words(1000, 100)},
            {"role": "user", "content": words(seed, n)}]


def test_non_streamed_reply_reports_reuse(client):
    messages = chat(1)
    first = client.chat.completions.create(model="tiny-qwen3.5", messages=messages,
                                           max_tokens=12, temperature=0)
    assert first.object == "chat.completion" and first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens > 64 and 1 <= first.usage.completion_tokens <= 12
    again = client.chat.completions.create(model="tiny-qwen3.5", messages=messages,
                                           max_tokens=12, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens


def test_streamed_reply_matches(client):
    messages = chat(2)
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=16,
                                           temperature=0)
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_logit_bias_and_min_tokens(client, server):
    """OpenAI's logit_bias pushes a token into every place of a greedy reply; vLLM's
    min_tokens keeps a stop token id out of the first tokens; bad values are 400s naming the
    field."""
    ask = {"model": "m", "messages": [{"role": "user", "content": "bias me"}], "temperature": 0}
    pushed = client.chat.completions.create(**ask, max_tokens=5, logit_bias={"40": 100},
                                            extra_body={"ignore_eos": True})
    assert pushed.choices[0].message.content == server.worker.engine.tokenizer.decode([40] * 5)
    prompt = server.worker.render(ask["messages"])
    ids = server.worker.submit(prompt,
                               SamplingParams(max_tokens=6, ignore_eos=True)).result().token_ids
    stopped = client.chat.completions.create(**ask, max_tokens=6, extra_body={
        "ignore_eos": True, "stop_token_ids": [ids[1]]})
    held = client.chat.completions.create(**ask, max_tokens=6, extra_body={
        "ignore_eos": True, "stop_token_ids": [ids[1]], "min_tokens": 4})
    assert stopped.usage.completion_tokens <= 2 and held.usage.completion_tokens >= 4
    for refused, field in [({"logit_bias": {"40": 200}}, "logit_bias"),
                           ({"logit_bias": {"10000000": 1}}, "logit_bias"),
                           ({"extra_body": {"min_tokens": 7}}, "min_tokens")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**ask, max_tokens=6, **refused)
        assert info.value.body["param"] == field


def test_a_reply_continues_the_last_assistant_message(client, server):
    """vLLM's continue_final_message (with add_generation_prompt false): the prompt ends inside
    the last assistant message, which the reply extends; the other combinations are 400s."""
    messages = [*chat(4, 20), {"role": "assistant", "content": "The answer starts"}]
    cont = client.chat.completions.create(model="m", messages=messages, max_tokens=4, extra_body={
        "continue_final_message": True, "add_generation_prompt": False})
    ids = server.worker.render(messages, add_generation_prompt=False)
    assert cont.usage.prompt_tokens == len(ids)
    assert server.worker.engine.tokenizer.decode(ids).endswith("The answer starts")
    for extra, param in (({"continue_final_message": True}, "add_generation_prompt"),
                         ({"add_generation_prompt": False}, "add_generation_prompt"),
                         ({"echo": True}, "echo")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=messages, max_tokens=2,
                                           extra_body=extra)
        assert info.value.body["param"] == param


def test_template_variables_of_the_server_and_the_request(client, server, monkeypatch):
    """`serve --chat-template-kwargs` sets the template's variables for every request; a
    request's own chat_template_kwargs win (a template that says whether thinking is on)."""
    tokenizer = server.worker.engine.tokenizer
    monkeypatch.setattr(tokenizer, "chat_template",
                        "{% if enable_thinking is defined and not enable_thinking %}"
                        "quick {% endif %}"
                        "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    monkeypatch.setattr(server, "template_kwargs", {"enable_thinking": False})
    messages = [{"role": "user", "content": "hello there"}]
    default = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    own = client.chat.completions.create(model="m", messages=messages, max_tokens=1,
                                         extra_body={"chat_template_kwargs":
                                                     {"enable_thinking": True}})
    assert default.usage.prompt_tokens == len(tokenizer.encode("quick hello there"))
    assert own.usage.prompt_tokens == len(tokenizer.encode("hello there"))


def test_vllm_sampling_fields_and_refused_ones(client):
    """top_k, stop_token_ids and ignore_eos (vLLM's extras, through the client's extra_body)
    reach the sampler; a penalty out of its range, or a field the server cannot honour, is a
    400 naming it, not silently ignored."""
    messages = chat(3)
    ask = {"model": "m", "messages": messages, "max_tokens": 12}
    greedy = client.chat.completions.create(**ask, temperature=0, extra_body={"ignore_eos": True})
    top1 = client.chat.completions.create(**ask, temperature=1.5,
                                          extra_body={"top_k": 1, "ignore_eos": True})
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    assert greedy.usage.completion_tokens == 12
    reply_ids = AutoTokenizer.from_pretrained(EMBEDDED_MODEL).encode(
        greedy.choices[0].message.content)
    stopped = client.chat.completions.create(**ask, temperature=0,
                                             extra_body={"stop_token_ids": [reply_ids[3]],
                                                         "ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < 12
    client.chat.completions.create(**ask, presence_penalty=0.5, frequency_penalty=0.5,
                                   extra_body={"min_p": 0.1, "repetition_penalty": 1.1})
    for refused, field in [({"presence_penalty": 3}, "presence_penalty"),
                           ({"extra_body": {"min_p": 2}}, "min_p"),
                           ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                           ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
                           ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**ask, **refused)
        assert info.value.body["param"] == field
    # chat_template_kwargs (Qwen's enable_thinking) go to the template; its own names do not
    client.chat.completions.create(model="m", messages=messages, max_tokens=2,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=messages, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"tokenize": False}})
    assert info.value.body["param"] == "chat_template_kwargs"


def test_logprobs_streamed_and_not(client):
    """logprobs and top_logprobs: one entry per generated token whose bytes are the token's
    (joined, they spell the reply), the likeliest first; a greedy token is the likeliest; a
    stream's chunks carry the same entries; without logprobs there are none."""
    ask = {"model": "m", "messages": chat(6), "max_tokens": 10, "temperature": 0,
           "logprobs": True, "top_logprobs": 3}
    whole = client.chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    # (cut mid-character)
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
    assert whole.choices[0].message.content and text.startswith(whole.choices[0].message.content)
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs),
                                                             reverse=True)
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    plain = client.chat.completions.create(**{**ask, "logprobs": False, "top_logprobs": 0})
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == whole.choices[0].message.content


def test_server_sampling_defaults_fill_what_a_request_leaves_out(client, server, monkeypatch):
    """`serve --temperature 1.5 --top-k 1 --max-tokens 3` (or the model's generation config)
    sets the sampling of every request; a request's own fields win."""
    ask = {"model": "m", "messages": chat(5), "extra_body": {"ignore_eos": True}}
    greedy = client.chat.completions.create(**ask, temperature=0, max_tokens=3)
    monkeypatch.setattr(server, "sampling", SamplingParams(temperature=1.5, top_k=1, max_tokens=3))
    default = client.chat.completions.create(**ask)
    assert default.usage.completion_tokens == 3
    assert default.choices[0].message.content == greedy.choices[0].message.content
    assert client.chat.completions.create(**ask, max_tokens=5).usage.completion_tokens == 5


def test_models_and_health(client, server):
    """The model list, OpenAI's retrieve of the served model (a 404 in OpenAI's shape for
    another id, a 405 naming GET for another method), and /health."""
    assert [m.id for m in client.models.list().data] == ["tiny-qwen3.5"]
    card = client.models.retrieve("tiny-qwen3.5")
    assert card.id == "tiny-qwen3.5" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as gone:
        client.models.retrieve("Qwen/Qwen3.5-9B")
    assert gone.value.body["code"] == "model_not_found" and "Qwen/Qwen3.5-9B" in gone.value.message
    status, body = raw_post(server, b"{}", path="/v1/models/tiny-qwen3.5")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    req = urllib.request.Request(f"{server.url}/health", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert json.loads(resp.read()) == {"status": "ok"}


def raw_post(server, body: bytes, key: str | None = KEY,
             path: str = "/v1/chat/completions") -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"{server.url}{path}", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_errors_have_openai_shape(client, server):
    status, body = raw_post(server, b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status, body = raw_post(server, json.dumps({"messages": []}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = raw_post(server, json.dumps({"messages": [{"role": "user", "content": "x"}],
                                                "temperature": "hot"}).encode())
    assert status == 400 and body["error"]["param"] == "temperature"
    for field, bad in (("seed", "18446744073709551616"), ("temperature", "NaN"),
                       ("temperature", "Infinity"), ("temperature", "1" + "0" * 400)):
        # (Python's JSON reads NaN and Infinity): refused before the request joins a step
        raw = '{"messages": [{"role": "user", "content": "x"}], "' + field + '": ' + bad + "}"
        status, body = raw_post(server, raw.encode())
        assert status == 400 and body["error"]["message"].startswith(field), body
    status, body = raw_post(server, b"{}", key="wrong")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    status, body = raw_post(server, b"{}", key=None)
    assert status == 401
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model="m", max_tokens=4,
                                       messages=[{"role": "user", "content": words(3, 1500)}])
    assert too_long.value.code == "context_length_exceeded"
    assert "context limit is 1024" in too_long.value.message
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="m", input="x")


def test_a_max_tokens_past_the_room_left_is_a_400(client):
    """As vLLM answers: a max_tokens (or max_completion_tokens) the conversation leaves no room
    for in the context is a 400 naming the field, not a reply cut short."""
    ask = {"model": "m", "messages": [{"role": "user", "content": words(5, 20)}], "max_tokens": 1}
    room = 1024 - client.chat.completions.create(**ask).usage.prompt_tokens
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**{**ask, field: room + 1})
        assert (info.value.body["param"], info.value.code) == (field, "context_length_exceeded")
        assert f"{field} is too large: {room + 1}; the context holds 1024 tokens" in \
            info.value.message and f"which leaves {room}" in info.value.message


def test_whole_number_floats_are_integers(client):
    """An integer field given as a whole-number float (3.0) is the integer it is, as vLLM's
    request models take it; 3.5 is a 400 naming the field."""
    ask = {"model": "m", "messages": [{"role": "user", "content": words(5, 20)}],
           "temperature": 0, "extra_body": {"ignore_eos": True}}
    reply = client.chat.completions.create(**ask, max_tokens=3.0, n=2.0)
    assert reply.usage.completion_tokens == 6 and len(reply.choices) == 2
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**ask, max_tokens=3.5)
    assert info.value.body["param"] == "max_tokens" and "an integer" in info.value.message


def test_eight_concurrent_clients(client):
    def one(i: int):
        stream = i % 2 == 0
        resp = client.chat.completions.create(model="m", messages=chat(10 + i, 60), max_tokens=24,
                                              temperature=0.8, seed=i, stream=stream)
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in resp if c.choices), "stream"
        return resp.choices[0].message.content, resp.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8), timeout=120))
    assert len(results) == 8 and all(isinstance(text, str) for text, _ in results)


def raw_http(server, request: bytes) -> tuple[int, dict]:
    """One request written byte by byte (headers a client library would not send); the
    status and JSON body of the answer, read until the server closes the connection."""
    host, port = server.server_address[:2]
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(request)
        conn.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_malformed_requests_get_an_answer(server):
    """Bodies and headers that once crashed the handler (no answer, a traceback in the log) or
    held its thread get an OpenAI-shaped error."""
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    for length in (b"-1", b"abc", b"1.5", b"9" * 5000):
        status, body = raw_http(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth
                                + b"Content-Length: " + length + b"\r\n\r\n{}")
        assert status == 400 and "Content-Length" in body["error"]["message"]
    chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth
               + b"Transfer-Encoding: chunked\r\n\r\n2x\r\n{}\r\n0\r\n\r\n")
    status, body = raw_http(server, chunked)  # (a chunked body is read: test_chunked.py)
    assert status == 400 and "chunk size" in body["error"]["message"]
    for line in (b"DELETE /v1/models", b"GET /v1/chat/completions", b"POST /health",
                 b"FOO /v1/completions"):  # (a route asked with another method)
        status, body = raw_http(server, line + b" HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
        assert status == 405 and body["error"]["code"] == "method_not_allowed", line
    assert raw_http(server, b"GET /v2/nothing HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")[0] == 404
    status, body = raw_http(server, b"garbage\r\n\r\n")  # (http.server's own error, as JSON)
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    head = urllib.request.Request(f"{server.url}/health", method="HEAD",
                                  headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(head, timeout=10) as resp:
        assert resp.status == 200 and resp.read() == b"" and int(resp.headers["Content-Length"]) > 0
    user = '{"messages": [{"role": "user", "content": "x"}], '
    for raw, field in [
        ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
        ('{"messages": ' + "[" * 5000 + "]" * 5000 + "}", None),  # nested past the recursion limit
        (user + '"max_tokens": 1' + "0" * 5000 + "}", None),  # an int past Python's digit limit
        (user + '"n": true}', "n"),
        (user + '"max_tokens": 5, "max_completion_tokens": 0}', "max_completion_tokens"),
        (user + '"stop": [""]}', "stop"),
    ]:
        status, body = raw_post(server, raw.encode())
        if raw.startswith('{"messages": [[') and body["error"]["param"] == "messages[0]":
            field = "messages[0]"  # (a Python whose JSON parser nests that deep: the list's
            # first item is then what is refused)
        assert status == 400 and body["error"]["param"] == field, (raw[:80], body)
    lower = urllib.request.Request(f"{server.url}/health",
                                   headers={"Authorization": f"bearer {KEY}"})
    with urllib.request.urlopen(lower, timeout=10) as resp:  # the scheme is case-insensitive
        assert resp.status == 200


def burst(clients: int = 32) -> list[bytes]:
    """The status of each of `clients` health checks whose connections were all opened before
    a fresh server (no engine: /health needs none) began to accept them (b"refused" where the
    connection could not even be opened: with a listen queue of 5, 26 of 32)."""
    srv = ChatServer(None, "m", "127.0.0.1", 0, quiet=True)
    conns: list[socket.socket | None] = []
    for _ in range(clients):
        try:
            conns.append(socket.create_connection(srv.server_address[:2], timeout=2))
        except OSError:
            conns.append(None)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    answers = []
    try:
        for conn in conns:
            if conn is None:
                answers.append(b"refused")
                continue
            with conn:
                try:
                    conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    data = b""
                    while chunk := conn.recv(65536):
                        data += chunk
                    answers.append(data.split(b" ", 2)[1] if data else b"closed")
                except OSError as e:
                    answers.append(type(e).__name__.encode())
    finally:
        srv.shutdown()
        srv.server_close()
    return answers


def test_a_burst_of_clients_is_queued_not_reset():
    """Connections opened while the server accepts none wait in its listen queue: with
    socketserver's default of 5, a burst of 100 clients had 80 of them reset."""
    assert burst() == [b"200"] * 32


def test_the_heap_is_frozen_while_serving():
    """serve() runs its loop with the objects alive at its start out of the collector's
    walks, and hands them back after."""
    import gc

    from statechat.api_serve import frozen_heap

    before = gc.get_freeze_count()
    with frozen_heap():
        assert gc.get_freeze_count() > before
    assert gc.get_freeze_count() == 0


def test_a_reply_cut_by_a_stopping_server_ends_with_abort():
    """A stream the server cuts when it stops (SIGTERM stops the worker) ends with finish_reason
    "abort", not the "stop" of a whole reply."""
    engine = LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu", max_model_len=1024),
                       loaded=load_model(EMBEDDED_MODEL, dtype=torch.float32))
    worker = EngineWorker(engine)
    srv = ChatServer(worker, "m", "127.0.0.1", 0, quiet=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 900,
                "ignore_eos": True, "stream": True}
        req = urllib.request.Request(f"{srv.url}/v1/chat/completions",
                                     data=json.dumps(body).encode())
        finishes = []
        with urllib.request.urlopen(req, timeout=60) as resp:
            for line in resp:
                if not line.startswith(b"data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if choice["delta"].get("content") and not finishes:
                    finishes.append(None)
                    threading.Thread(target=worker.shutdown).start()  # (as serve()'s SIGTERM)
                if choice["finish_reason"]:
                    finishes.append(choice["finish_reason"])
        assert finishes == [None, "abort"]
    finally:
        srv.shutdown()
        srv.server_close()
        worker.shutdown()


def test_a_body_over_the_limit_gets_its_413(server):
    """A body past the 32 MiB limit is read and dropped, so the client, still sending it, reads
    the 413 (the server closed on it, and the client met a broken pipe); the connection then
    serves the next request."""
    import http.client

    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/chat/completions", b" " * (33 << 20), headers)
    resp = conn.getresponse()
    assert resp.status == 413 and "over 32 MiB" in json.loads(resp.read())["error"]["message"]
    conn.request("GET", "/health", headers=headers)
    assert conn.getresponse().status == 200
    conn.close()


def own_server() -> tuple[ChatServer, EngineWorker, threading.Thread]:
    """A server of its own (a test that stops it), serving from a thread."""
    loaded = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    worker = EngineWorker(LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu"),
                                    loaded=loaded))
    srv = ChatServer(worker, "tiny-qwen3.5", "127.0.0.1", 0, api_key=KEY, quiet=True)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    return srv, worker, thread


def test_a_stop_closes_idle_keep_alive_connections():
    """Stopping (serve's SIGTERM or Ctrl-C) closes a client's idle keep-alive connection, so its
    next request fails at once (it hung until the process ended, then was reset), as uvicorn
    closes them."""
    import http.client

    srv, worker, thread = own_server()
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=30)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        conn.request("GET", "/health", headers=auth)
        assert conn.getresponse().read() and conn.sock is not None  # (kept alive)
        srv.shutdown()
        srv.stop()
        start = time.monotonic()
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            conn.request("GET", "/health", headers=auth)
            conn.getresponse()
        assert time.monotonic() - start < 5 and not worker._thread.is_alive()
    finally:
        conn.close()
        thread.join(10)


def test_a_request_that_comes_as_the_engine_stops_is_a_503():
    """A request a keep-alive connection sends while the engine shuts down is the server's
    503 (shutting_down), not a 400 blaming the prompt."""
    srv, worker, thread = own_server()
    try:
        assert worker.shutdown()
        status, body = raw_post(srv, b'{"messages": [{"role": "user", "content": "hi"}]}')
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(10)
    assert status == 503 and body["error"]["code"] == "shutting_down"
    assert body["error"]["type"] == "server_error" and body["error"]["param"] is None


def wait_for(ready, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        assert time.monotonic() < deadline
        time.sleep(0.005)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_in_flight_when_the_engine_stops_answers_every_choice(capsys, stream):
    """With n > 1, choice 0 is queued first and the others after it; when the engine stops in
    between, the request (taken before the stop) is answered as one of a single
    choice is, not with a 503: every choice ends with finish_reason "abort", those the engine
    would not take with no tokens. Choice 0's reuse line is logged, marked aborted (it ran);
    the others, which never ran, log none."""
    srv, worker, thread = own_server()
    srv.quiet = False
    engine, gate = worker.engine, threading.Event()
    step = engine.step

    def gated_step():  # choice 0 waits in the engine until the stop is under way
        assert gate.wait(30)
        return step()

    engine.step = gated_step
    submit, stopping = worker.submit, threading.Thread(target=worker.shutdown)

    def submit_then_stop(*args, **kwargs):  # (the stop comes right after choice 0 is queued)
        handle = submit(*args, **kwargs)
        if not stopping.is_alive():
            stopping.start()
            wait_for(lambda: worker._stopping)
        return handle

    worker.submit = submit_then_stop
    content = " ".join(["stop while the first choice runs"] * 30)
    body = {"messages": [{"role": "user", "content": content}], "n": 3, "max_tokens": 5,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post_any, srv, body)
            wait_for(lambda: worker._stopping)
            gate.set()
            status, reply = answer.result(30)
            stopping.join(30)
    finally:
        gate.set()
        srv.shutdown()
        srv.stop()  # (waits for the request's thread: it logs the reuse after the answer)
        thread.join(10)
    assert status == 200, reply
    if stream:
        choices = [c["choices"][0] for c in reply if c["choices"]]
        finishes = {c["index"]: c["finish_reason"] for c in choices if c["finish_reason"]}
        assert not [c for c in choices if c["index"] and c["delta"].get("content")]
        usage = reply[-1]["usage"]
    else:
        finishes = {c["index"]: c["finish_reason"] for c in reply["choices"]}
        assert [c["message"]["content"] for c in reply["choices"][1:]] == ["", ""]
        usage = reply["usage"]
    assert finishes == {0: "abort", 1: "abort", 2: "abort"} and usage["prompt_tokens"] > 700
    lines = [line for line in capsys.readouterr().err.splitlines() if "prompt tokens" in line]
    assert len(lines) == 1 and lines[0].endswith("; aborted")


def post_any(server, body: dict) -> tuple[int, dict | list[dict]]:
    """The status and JSON answer of a chat request, or a stream's chunks."""
    status, text = 0, ""
    req = urllib.request.Request(f"{server.url}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if not body.get("stream"):
        return status, json.loads(text)
    return status, [json.loads(line[6:]) for line in text.splitlines()
                    if line.startswith("data: {")]


def test_a_gets_body_is_not_read_as_the_next_request(server):
    """A GET that carries a body (some clients send `{}`) is answered, and its body is not
    taken for the next request on the keep-alive connection."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=30)
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    try:
        for path, body in (("/v1/models", "{}"), ("/health", None), ("/health", "{}"),
                           ("/v1/models", None)):
            conn.request("GET", path, body=body, headers=auth)
            resp = conn.getresponse()
            assert resp.status == 200, (path, resp.read())
            json.loads(resp.read())
    finally:
        conn.close()


def test_an_ipv6_address_is_served(server):
    """`serve --host ::1` (or `::`) listens on IPv6, as uvicorn's does; it was refused
    ("Address family for hostname not supported")."""
    try:  # (a container may make IPv6 sockets yet have no ::1 to bind)
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    six = ChatServer(server.worker, "tiny-qwen3.5", "::1", 0, api_key=KEY, quiet=True)
    assert six.url.startswith("http://[::1]:")
    assert served_model(six) == "tiny-qwen3.5"


def served_model(srv: ChatServer) -> str:
    """Serve `srv` (a second server over the module's worker) until its /v1/models has
    answered; the id it names. The server is closed after."""
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        req = urllib.request.Request(f"{srv.url}/v1/models",
                                     headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())["data"][0]["id"]
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(10)


def test_a_socket_bound_ahead_is_refused_until_served_then_served(server):
    """`serve` binds its port before the model loads (api_serve.bind): until the server takes
    the socket a client is refused at once (not left hanging), and then it is served there."""
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    srv = ChatServer(server.worker, "tiny-qwen3.5", "127.0.0.1", port, api_key=KEY, quiet=True,
                     sock=sock)
    assert srv.url == f"http://127.0.0.1:{port}"
    assert served_model(srv) == "tiny-qwen3.5"


def test_a_port_another_serve_bound_while_it_loads_is_refused_at_once(server):
    """Two `serve --port P` started together (a second one while the first still loads its
    model): the second's bind fails at once, before its own load. Both bound the port (each
    with SO_REUSEADDR, which lets sockets not listening yet share it), so the second loaded a
    whole model (on the same GPU) only to find the port taken at its listen. A port whose
    stopped server's connections wait out TIME_WAIT still binds (a restart)."""
    import errno

    first = bind("127.0.0.1", 0)
    port = first.getsockname()[1]
    try:
        with pytest.raises(OSError) as refused:
            bind("127.0.0.1", port).close()
        assert refused.value.errno == errno.EADDRINUSE
    finally:
        first.close()
    srv = ChatServer(server.worker, "tiny-qwen3.5", "127.0.0.1", port, api_key=KEY, quiet=True,
                     sock=bind("127.0.0.1", port))
    assert served_model(srv) == "tiny-qwen3.5"  # (the server closes first: its side waits)
    again = bind("127.0.0.1", port)
    again.close()


def test_control_characters_of_a_request_line_are_logged_escaped(server, capsys, monkeypatch):
    """A request line's control characters (a terminal's escape sequences, a carriage return)
    reached the server's log as they were, so any client could recolour, retitle or rewrite the
    terminal that runs `statechat serve`; they are now shown escaped, as http.server's own
    log escapes them."""
    monkeypatch.setattr(server, "quiet", False)
    capsys.readouterr()
    with socket.create_connection(server.server_address[:2], timeout=10) as sock:
        sock.sendall(b"GET /\x1b[2J\x1b]0;owned\x07\r HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 401")  # (the answer: the line is logged)
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "GET /" in line]
    assert line.endswith(r'"GET /\x1b[2J\x1b]0;owned\x07\x0d HTTP/1.1" 401 -')


def test_a_stop_waits_for_the_cache_writes_and_says_when_it_gave_up(capsys):
    """The stop gives the engine's pending cache writes as long as `run`'s quit does (it gave
    them 30 s and then exited without a word); past that it says what was lost."""
    class SlowWorker:
        def __init__(self, stops: bool) -> None:
            self.stops, self.waited = stops, None

        def shutdown(self, timeout=None) -> bool:
            self.waited = timeout
            return self.stops

    for stops in (True, False):
        worker = SlowWorker(stops)
        srv = ChatServer(worker, "m", "127.0.0.1", 0, quiet=True, warm_next_turn=False)
        srv.stop()
        assert worker.waited == 90
        err = capsys.readouterr().err
        assert ("cache writes still pending are lost" in err) is not stops
