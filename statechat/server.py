"""OpenAI-compatible HTTP API on the standard library: ThreadingHTTPServer + server-sent events.

    POST /v1/chat/completions   (stream true/false; usage.prompt_tokens_details.cached_tokens)
    GET  /v1/models
    GET  /health

Each connection gets a thread; all of them submit to one EngineWorker, so concurrent clients
share the engine's batch. Errors have OpenAI's shape: {"error": {"message", "type", "param",
"code"}}. With an API key, every request needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import hmac
import json
import sys
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from statechat.chat.template import ROLES, merge_template_kwargs
from statechat.engine.engine import RequestOutput
from statechat.engine.sampling import SamplingParams
from statechat.engine.worker import EngineWorker
from statechat.errors import ContextLengthError, StatechatError

MAX_BODY_BYTES = 32 << 20
SOCKET_TIMEOUT_S = 300  # a connection that sends or reads nothing for this long is closed
DEFAULT_MAX_TOKENS = 2048
# Fields of OpenAI's and vLLM's APIs this server cannot honour, with the values that leave them
# off (clients send those by default, and they are taken); any other value is a 400 rather
# than a reply made as if it had not been asked for.
NOT_SUPPORTED = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,),
    "min_tokens": (0,), "logprobs": (False,), "top_logprobs": (0,), "logit_bias": ({},),
    "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
    "response_format": ({"type": "text"},), "best_of": (1,), "guided_json": (),
    "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "use_beam_search": (False,), "prompt_logprobs": (0,), "allowed_token_ids": ([],),
    "bad_words": ([],), "function_call": ("none", "auto"), "echo": (False,), "chat_template": (),
    "documents": ([],), "add_special_tokens": (False,),
}


class ApiError(Exception):
    """An error sent to the client as OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _content(msg: dict, i: int) -> str:
    content = msg.get("content")
    if content is None and msg.get("role") == "assistant":
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                       f"messages[{i}].content")
    try:
        content.encode()
    except UnicodeEncodeError:  # JSON's \ud800 escapes make lone surrogates
        raise ApiError(400, f"messages[{i}].content is not valid Unicode (a lone surrogate)",
                       f"messages[{i}].content") from None
    return content


def parse_messages(raw) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty array", "messages")
    out = []
    for i, msg in enumerate(raw):
        role = msg.get("role") if isinstance(msg, dict) else None
        role = "system" if role == "developer" else role
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}",
                           f"messages[{i}].role")
        out.append({"role": role, "content": _content(msg, i)})
    return out


def _number(body: dict, key: str, kind: type, default):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ApiError(400, f"{key} must be {'a number' if kind is float else 'an integer'}", key)
    try:
        return kind(value)
    except OverflowError:  # an integer past float's range
        raise ApiError(400, f"{key} is out of range", key) from None


def _is_off(value, off) -> bool:
    """Whether `value` is the off value `off`: numbers by value (0.0 is 0), booleans only as
    themselves (False is not the 0 of a penalty, 0 not the False of logprobs)."""
    if isinstance(value, bool) or isinstance(off, bool):
        return value is off
    return value == off


def _refuse_unsupported(body: dict) -> None:
    """ApiError(400) for a NOT_SUPPORTED field set to anything but an off value."""
    for key, offs in NOT_SUPPORTED.items():
        value = body.get(key)
        if value is not None and not any(_is_off(value, off) for off in offs):
            raise ApiError(400, f"{key} is not supported by this server; leave it out", key)


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ApiError(400, "stop_token_ids must be an array of integers", "stop_token_ids")
    return tuple(ids)


def _flag(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"{key} must be true or false", key)
    return value


def _continues(body: dict, messages: list[dict]) -> bool:
    """Whether the reply continues the last (assistant) message: vLLM's continue_final_message,
    with add_generation_prompt false. A closed assistant turn with no generation prompt, which
    the engine's rendering does not make, is a 400."""
    if _flag(body, "continue_final_message"):
        if _flag(body, "add_generation_prompt", True):
            raise ApiError(400, "continue_final_message needs add_generation_prompt false",
                           "add_generation_prompt")
        if messages[-1]["role"] != "assistant":
            raise ApiError(400, "continue_final_message needs an assistant message last",
                           "messages")
        return True
    if not _flag(body, "add_generation_prompt", True):
        raise ApiError(400, "add_generation_prompt false is supported only with "
                            "continue_final_message true", "add_generation_prompt")
    return False


def parse_params(body: dict, prompt_len: int, max_model_len: int) -> SamplingParams:
    """SamplingParams from a chat-completions body (OpenAI's fields, and vLLM's top_k,
    stop_token_ids and ignore_eos); ApiError(400) for a bad field or one it cannot honour."""
    _refuse_unsupported(body)
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise ApiError(400, "only n=1 is supported", "n")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or an array of strings", "stop")
    room = max(1, max_model_len - prompt_len)
    max_tokens = None
    for key in ("max_completion_tokens", "max_tokens"):  # (the latter wins, as with OpenAI)
        value = _number(body, key, int, None)
        if value is not None and value < 1:
            raise ApiError(400, f"{key} must be >= 1", key)
        max_tokens = value if value is not None else max_tokens
    top_k = _number(body, "top_k", int, 0)
    try:
        return SamplingParams(
            temperature=_number(body, "temperature", float, 1.0),
            top_p=_number(body, "top_p", float, 1.0),
            top_k=0 if top_k == -1 else top_k,  # (vLLM's -1 is off, as 0 is)
            seed=_number(body, "seed", int, None),
            max_tokens=min(max_tokens, room) if max_tokens is not None else min(DEFAULT_MAX_TOKENS, room),
            stop=tuple(stop),
            stop_token_ids=_stop_token_ids(body),
            ignore_eos=_flag(body, "ignore_eos"),
        )
    except StatechatError as e:  # (its message starts with the field's name)
        field = str(e).split(maxsplit=1)[0] if str(e) else ""
        raise ApiError(400, str(e), field if field in body else None) from None


def usage(out: RequestOutput) -> dict:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_completion_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


class ChatServer(ThreadingHTTPServer):
    """The HTTP server: holds the worker, the served model id and the optional API key."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, worker: EngineWorker, model_id: str, host: str = "127.0.0.1",
                 port: int = 8000, api_key: str | None = None, quiet: bool = False,
                 template_kwargs: dict | None = None) -> None:
        super().__init__((host, port), Handler)
        self.worker, self.model_id, self.api_key, self.quiet = worker, model_id, api_key, quiet
        self.template_kwargs = template_kwargs or {}  # defaults; a request's own win
        self.created = int(time.time())

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S
    server: ChatServer

    # --- plumbing -----------------------------------------------------------------------
    def log_message(self, format: str, *args) -> None:
        if not self.server.quiet:
            sys.stderr.write(f"{self.address_string()} {format % args}\n")

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _guard(self, route) -> None:
        self._body_read = False  # per request: a keep-alive connection carries several
        try:
            if self.server.api_key and not self._authorized():
                raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                               code="invalid_api_key", kind="authentication_error")
            route()
        except ApiError as e:
            self._drain()
            self._send_json(e.status, e.body())

    def _authorized(self) -> bool:
        scheme, _, key = self.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(),
                                                                  self.server.api_key.encode())

    def _length(self) -> int | None:
        """The body's Content-Length; None when it is not a plain count of bytes (or the body
        comes in chunks), and the connection is then closed after the answer."""
        raw = self.headers.get("Content-Length") or "0"
        if self.headers.get("Transfer-Encoding") or not (raw.isascii() and raw.isdigit()) or len(raw) > 12:
            self.close_connection = True
            return None
        return int(raw)

    def _drain(self) -> None:
        """Read an unread request body so the connection stays usable."""
        if not self._body_read:
            n = self._length()
            if n is not None and 0 < n <= MAX_BODY_BYTES:
                self.rfile.read(n)
            elif n:
                self.close_connection = True
            self._body_read = True

    def _body(self) -> dict:
        n = self._length()
        if n is None:
            self._body_read = True  # (not read: the connection closes)
            raise ApiError(400, "send the request body with a Content-Length of its bytes")
        if n > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        raw = self.rfile.read(n)
        self._body_read = True
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # (an int of over 4300 digits is a ValueError)
            raise ApiError(400, f"the request body is not valid JSON ({str(e)[:200]})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    # --- routes -------------------------------------------------------------------------
    def do_GET(self) -> None:
        routes = {"/health": self._health, "/v1/models": self._models}
        self._guard(routes.get(self.path.split("?")[0].rstrip("/") or "/", self._not_found))

    def do_POST(self) -> None:
        routes = {"/v1/chat/completions": self._chat}
        self._guard(routes.get(self.path.split("?")[0].rstrip("/"), self._not_found))

    def _not_allowed(self) -> None:
        raise ApiError(405, f"method {self.command} is not supported: GET /v1/models, /health; "
                            "POST /v1/chat/completions", code="method_not_allowed")

    def do_PUT(self) -> None:
        self._guard(self._not_allowed)

    do_DELETE = do_PATCH = do_OPTIONS = do_PUT

    def _not_found(self) -> None:
        raise ApiError(404, f"no route {self.command} {self.path}", code="not_found")

    def _health(self) -> None:
        self._send_json(200, {"status": "ok"})

    def _models(self) -> None:
        model = {"id": self.server.model_id, "object": "model", "created": self.server.created,
                 "owned_by": "statechat", "max_model_len": self.server.worker.max_model_len}
        self._send_json(200, {"object": "list", "data": [model]})

    def _chat(self) -> None:
        body = self._body()
        worker = self.server.worker
        try:
            messages = parse_messages(body.get("messages"))
            prompt_ids = worker.render(messages, not _continues(body, messages),
                                       template_kwargs=merge_template_kwargs(
                                           self.server.template_kwargs, body.get("chat_template_kwargs")))
        except StatechatError as e:
            kwargs = str(e).startswith("chat_template_kwargs")
            raise ApiError(400, str(e), "chat_template_kwargs" if kwargs else "messages") from None
        params = parse_params(body, len(prompt_ids), worker.max_model_len)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "stream must be true or false", "stream")
        options = body.get("stream_options") or {}
        include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
        try:
            handle = worker.submit(prompt_ids, params)
        except ContextLengthError as e:
            raise ApiError(400, f"{e}; shorten the conversation", "messages",
                           "context_length_exceeded") from None
        except StatechatError as e:
            raise ApiError(400, str(e), "messages") from None
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        try:
            if stream:
                self._stream(handle, rid, include_usage)
            else:
                out = handle.result()
                self._send_json(200, self._completion(rid, out))
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            handle.abort()
            self.close_connection = True
        except Exception as e:
            if stream:
                raise
            raise ApiError(500, str(e).splitlines()[0] if str(e) else type(e).__name__,
                           kind="server_error") from None
        finally:
            handle.abort()  # no-op once finished

    def _completion(self, rid: str, out: RequestOutput) -> dict:
        self._log_reuse(out)
        return {
            "id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": self.server.model_id,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "logprobs": None, "finish_reason": _finish(out)}],
            "usage": usage(out),
        }

    def _stream(self, handle, rid: str, include_usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.server.model_id}

        def send(choices: list, **extra) -> None:
            self.wfile.write(f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n".encode())
            self.wfile.flush()

        send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        try:
            for event in handle:
                if event.text:
                    send([{"index": 0, "delta": {"content": event.text}, "finish_reason": None}])
                if event.output is not None:
                    self._log_reuse(event.output)
                    send([{"index": 0, "delta": {}, "finish_reason": _finish(event.output)}])
                    if include_usage:
                        send([], usage=usage(event.output))
        except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client is gone
            raise
        except Exception as e:  # noqa: BLE001 - headers are sent: report in the stream
            err = ApiError(500, str(e).splitlines()[0] if str(e) else type(e).__name__,
                           kind="server_error")
            self.wfile.write(f"data: {json.dumps(err.body())}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _log_reuse(self, out: RequestOutput) -> None:
        plan = out.cache_plan or {}
        choice = (f"; {plan['choice']}: loading {plan['candidate_tokens']:,} tokens predicted "
                  f"{plan['predicted_load_s'] * 1e3:.1f} ms, recomputing them "
                  f"{plan['predicted_recompute_s'] * 1e3:.1f} ms") if plan.get("candidate_tokens") else ""
        if "disk_resident" in plan:
            choice += f" (page cache held {plan['disk_resident']:.0%} of the disk part)"
        self.log_message(
            "reused %s of %s prompt tokens%s; computed %s; %s new%s",
            f"{out.num_cached_tokens:,}", f"{out.num_prompt_tokens:,}",
            f" from {out.reused_from}" if out.reused_from else "",
            f"{out.num_computed_tokens:,}", out.num_completion_tokens, choice,
        )


def _finish(out: RequestOutput) -> str:
    return "length" if out.finish_reason == "length" else "stop"


def serve(worker: EngineWorker, model_id: str, host: str, port: int,
          api_key: str | None = None, template_kwargs: dict | None = None) -> None:
    """Serve until Ctrl-C or SIGTERM, then stop the worker (flushing pending cache writes)."""
    import signal

    def _stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    server = ChatServer(worker, model_id, host, port, api_key, template_kwargs=template_kwargs)
    auth = " (API key required)" if api_key else ""
    print(f"statechat: serving {model_id} at {server.url}/v1{auth}; Ctrl-C stops", file=sys.stderr)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        worker.shutdown()
