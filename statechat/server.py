"""OpenAI-compatible HTTP API on the standard library: ThreadingHTTPServer + server-sent events.

    POST /v1/chat/completions   (stream true/false, n choices; usage...cached_tokens)
    POST /v1/completions        (the legacy text API: prompts as text or token ids, echo)
    POST /v1/responses, GET or DELETE /v1/responses/ID, GET /v1/responses/ID/input_items
                                (OpenAI's Responses API: api_responses_http.py,
                                api_responses_items.py; stored responses in memory)
    POST /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API: api_anthropic*.py)
    GET  /v1/models, /v1/models/ID (the served model; a 404 for another id)
    GET  /health, GET or POST /ping (probes), GET /version
    POST /tokenize, /detokenize (vLLM's: a text's or a chat's token ids, and back)
    GET  /metrics               (Prometheus's text format: api_metrics.py)

Each connection gets a thread; all of them submit to one EngineWorker, so concurrent clients
share the engine's batch. Errors have OpenAI's shape: {"error": {"message", "type", "param",
"code"}} (Anthropic's on its routes). With an API key, every request but /health, /ping and
/metrics needs `Authorization: Bearer KEY` (or `x-api-key: KEY`; as vLLM's, which leaves its
probes and /metrics open). Pages of the allowed origins (those of this machine, by default) may
call it from a browser (CORS). A request's body is checked by statechat/api_request.py (and
api_chat.py or api_completions.py)
and answered by api_answer.py: its choices are submitted, awaited and streamed by
api_choices.py, and written as a response or a stream's chunks by api_response.py, which the
two APIs share.
Fields of a body that its API does not read (bar those ignored on purpose,
api_request.IGNORED_FIELDS) are named in one warning line of the log, and the request is
served without them. Reading bodies, answering JSON, CORS and the errors' shape are
api_http.py's (JsonHandler); the process that serves it (signals, the stop) is api_serve.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import sys
import threading
import time
import urllib.parse
from http.server import ThreadingHTTPServer

from statechat import __version__
from statechat.api_answer import AnswerHandler
from statechat.api_anthropic import ANTHROPIC_ROUTES, COUNT_ROUTE, MESSAGES_ROUTE, error_body
from statechat.api_anthropic_answer import count_tokens, messages
from statechat.api_chat import CHAT_FIELDS, chat_request
from statechat.api_completions import (
    COMPLETION_FIELDS,
    DEFAULT_MAX_TOKENS,
    CompletionShape,
    parse_completion,
)
from statechat.api_cors import LOCAL_ORIGINS
from statechat.api_metrics import CONTENT_TYPE, ServerMetrics
from statechat.api_next_turn import NextTurns
from statechat.api_reasoning import check_parser
from statechat.api_request import DEFAULT_SAMPLING, ApiError, named, parse_n, unknown_fields
from statechat.api_responses_http import (
    RESPONSE_ROUTE,
    delete_response,
    get_response,
    is_response_route,
    post_response,
)
from statechat.api_responses_items import ITEMS_ROUTE, list_input_items
from statechat.api_responses_store import ResponseStore
from statechat.api_tokens import detokenize, tokenize
from statechat.api_tools import check_tool_parser
from statechat.engine.sampling import SamplingParams
from statechat.engine.worker import EngineWorker

ROUTES = {"/health": "GET, HEAD", "/ping": "GET, HEAD, POST", "/version": "GET, HEAD",
          "/v1/models": "GET, HEAD", "/v1/chat/completions": "POST", "/v1/completions": "POST",
          "/tokenize": "POST", "/detokenize": "POST",
          MESSAGES_ROUTE: "POST", COUNT_ROUTE: "POST",
          "/metrics": "GET, HEAD", "/v1/responses": "POST",
          RESPONSE_ROUTE: "GET, HEAD, DELETE"}  # each route's methods (a 405's Allow; a
# route ending in / is a prefix: its id follows)
# routes served without the API key, as vLLM serves them: its and SageMaker's probes, and the
# Prometheus scrape (counts and pool sizes: nothing of a conversation)
KEYLESS = ("/health", "/ping", "/metrics")
MODEL_ROUTE = "/v1/models/"  # + a model's id (which may hold slashes): OpenAI's retrieve
STOP_WAIT_S = 10  # how long a stop waits for the answers still being written
FLUSH_WAIT_S = 90  # how long it waits for the engine to stop and the cache's writes (as `run`)


class ChatServer(ThreadingHTTPServer):
    """The HTTP server: holds the worker, the served model id, the optional API key and the
    defaults of every request (sampling, chat-template variables), which a request's own
    fields override, and the origins whose browser pages may call it (CORS; "*" any). A text
    completion's max_tokens defaults to `completion_max_tokens` (OpenAI's 16 unless `serve
    --max-tokens` was given), and a chat reply is split by `reasoning_parser` and parsed for
    tool calls by `tool_call_parser` (None: not; without it, tools are refused)."""

    daemon_threads = True
    allow_reuse_address = True
    # connections the kernel queues before they are accepted (socketserver's 5 reset a burst of
    # clients: 80 of 100 at once); uvicorn, which vLLM runs, asks for 2048
    request_queue_size = 2048

    def __init__(self, worker: EngineWorker, model_id: str, host: str = "127.0.0.1",
                 port: int = 8000, api_key: str | None = None, quiet: bool = False,
                 template_kwargs: dict | None = None, sampling: SamplingParams | None = None,
                 completion_max_tokens: int | None = None, warm_next_turn: bool = True,
                 allowed_origins: tuple[str, ...] = LOCAL_ORIGINS,
                 sock: socket.socket | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None,
                 trust_request_chat_template: bool = False) -> None:
        """`sock`: a socket api_serve.bind made (host and port are then its own), else one is
        bound. `trust_request_chat_template`: render a request's own chat_template (else it is
        a 400: a template is code, which may loop for hours with the tokenizer held)."""
        # (an IPv6 address, "::" or "::1", needs a socket of its family: AF_INET refuses it)
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), Handler, bind_and_activate=sock is None)
        if sock is not None:
            self.socket.close()
            # (bind took it alone; its connections' TIME_WAIT must not hold up a restart)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket, self.server_address = sock, sock.getsockname()
            self.server_name, self.server_port = self.server_address[:2]
            self.server_activate()
        self.worker, self.model_id, self.api_key, self.quiet = worker, model_id, api_key, quiet
        self.template_kwargs, self.allowed_origins = template_kwargs or {}, allowed_origins
        self.next_turns = NextTurns(worker, self.template_kwargs) if warm_next_turn else None
        self.sampling = sampling or DEFAULT_SAMPLING
        self.completion_max_tokens = completion_max_tokens or DEFAULT_MAX_TOKENS
        self.reasoning_parser = check_parser(reasoning_parser)
        self.tool_call_parser = check_tool_parser(tool_call_parser)
        self.trust_request_chat_template = trust_request_chat_template
        self.created = int(time.time())
        self.metrics = ServerMetrics()  # the counts GET /metrics shows (api_answer.py's)
        self.responses = ResponseStore()  # the Responses API's stored responses
        self.is_stopping = False  # set by stop(): connections close after their request
        self._connections = threading.Condition()  # guards the two sets below
        self._idle: set[Handler] = set()  # connections waiting for their next request
        self._busy: set[Handler] = set()  # connections answering one

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Stop as uvicorn does: accept no connection, stop the worker (replies under way end
        with "abort", a request's choices not started yet too; a request that comes meanwhile
        is a 503; its pending cache writes get up to FLUSH_WAIT_S, and a line says so past
        it), then close the idle keep-alive connections (a client sees them closed, not hung)
        and wait up to `wait_s` for the answers still being written."""
        self.server_close()
        if not self.worker.shutdown(FLUSH_WAIT_S):
            print(f"statechat: the engine had not stopped after {FLUSH_WAIT_S} s; cache writes "
                  "still pending are lost (the cache stays usable)", file=sys.stderr)
        with self._connections:
            self.is_stopping = True
            idle = list(self._idle)
        for handler in idle:
            with contextlib.suppress(OSError):
                handler.connection.shutdown(socket.SHUT_RDWR)
        with self._connections:
            self._connections.wait_for(lambda: not self._busy, wait_s)

    def connection_state(self, handler: Handler, busy: bool | None) -> None:
        """Track a connection: busy (answering), idle (waiting for a request) or None (gone).
        Once stopping, a connection is closed after its answer."""
        with self._connections:
            self._idle.discard(handler)
            self._busy.discard(handler)
            if busy:
                self._busy.add(handler)
            elif busy is not None and self.is_stopping:
                handler.close_connection = True
            elif busy is not None:
                self._idle.add(handler)
            self._connections.notify_all()

    @property
    def url(self) -> str:
        return f"http://{host_port(*self.server_address[:2])}"


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 address in brackets (`[::1]:8000`), as a URL writes it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Handler(AnswerHandler):
    """The API's routes, on JsonHandler's transport; AnswerHandler answers a parsed request."""

    server: ChatServer

    # --- routes -------------------------------------------------------------------------
    def _route(self) -> str:
        """The target's path, less its query, trailing slash, and scheme and host when it is
        in absolute form (`http://host:port/v1/models`, which HTTP/1.1 servers must take)."""
        path = self.path.split("?")[0]
        scheme, sep, rest = path.partition("://")
        if sep and scheme.lower() in ("http", "https"):
            path = "/" + rest.partition("/")[2]
        return path.rstrip("/") or "/"

    def do_GET(self) -> None:  # (HEAD: the same answers, without their bodies)
        route = self._route()
        routes = {"/health": self._health, "/ping": self._health, "/version": self._version,
                  "/v1/models": self._models, "/metrics": self._metrics}
        handler = self._model if route.startswith(MODEL_ROUTE) else routes.get(route)
        if is_response_route(route):
            handler = self._stored_response
        elif is_response_route(route, ITEMS_ROUTE):
            handler = lambda: list_input_items(self)
        self._guard(handler or self._unrouted, is_open=route in KEYLESS)

    def do_POST(self) -> None:
        route = self._route()
        routes = {"/v1/chat/completions": self._chat, "/v1/completions": self._completions,
                  "/tokenize": self._tokenize, "/detokenize": self._detokenize,
                  "/ping": self._health, "/v1/responses": self._responses,
                  MESSAGES_ROUTE: lambda: messages(self), COUNT_ROUTE: lambda: count_tokens(self)}
        self._guard(routes.get(route, self._unrouted), is_open=route in KEYLESS)

    do_HEAD = do_GET

    def do_PUT(self) -> None:
        self._guard(self._unrouted)

    def do_OPTIONS(self) -> None:
        if not self._preflight():  # (a plain OPTIONS: no route takes it)
            self._guard(self._unrouted)

    do_PATCH = do_PUT

    def do_DELETE(self) -> None:
        route = self._route()
        self._guard(self._delete_response if is_response_route(route) else self._unrouted)

    def _methods_message(self) -> str:
        return (f"method {self.command} is not supported here: GET (or HEAD) /v1/models, "
                "/v1/models/ID, /v1/responses/ID, /v1/responses/ID/input_items, /health, "
                "/ping, /version, /metrics; POST "
                "/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, "
                "/v1/messages/count_tokens, /tokenize, /detokenize, /ping; DELETE /v1/responses/ID")

    def _error_body(self, error: ApiError) -> dict:
        """Anthropic's error shape on its routes, OpenAI's elsewhere."""
        return error_body(error) if self._route() in ANTHROPIC_ROUTES else error.body()

    def _allow(self) -> dict[str, str]:
        route = self._route()
        methods = ROUTES["/v1/models"] if route.startswith(MODEL_ROUTE) else ROUTES.get(route)
        methods = ROUTES[RESPONSE_ROUTE] if is_response_route(route) else methods
        methods = "GET, HEAD" if is_response_route(route, ITEMS_ROUTE) else methods
        return {"Allow": methods} if methods else {}

    def _unrouted(self) -> None:
        """A 405 for a route served to another method (its Allow header naming those it
        takes), else a 404."""
        if self._allow():
            raise ApiError(405, self._methods_message(), code="method_not_allowed",
                           headers=self._allow())
        raise ApiError(404, f"no route {self.command} {self.path}", code="not_found")

    def _health(self) -> None:
        self._send_json(200, {"status": "ok"})

    def _metrics(self) -> None:
        """Prometheus's scrape: the counts as text (HEAD: its headers alone)."""
        data = self.server.metrics.render(self.server.worker.engine).encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _version(self) -> None:
        self._send_json(200, {"version": __version__})

    def _tokenize(self) -> None:
        self._send_json(200, tokenize(self.server, self._body()))

    def _detokenize(self) -> None:
        self._send_json(200, detokenize(self.server, self._body()))

    def _model_card(self) -> dict:
        return {"id": self.server.model_id, "object": "model", "created": self.server.created,
                "owned_by": "statechat", "max_model_len": self.server.worker.max_model_len}

    def _models(self) -> None:
        self._send_json(200, {"object": "list", "data": [self._model_card()]})

    def _model(self) -> None:
        """GET /v1/models/ID (the id percent-encoded or not): the served model, as OpenAI's
        retrieve answers; a 404 in OpenAI's words for any other id."""
        wanted = urllib.parse.unquote(self._route()[len(MODEL_ROUTE):])
        if wanted != self.server.model_id:
            raise ApiError(404, f"The model `{wanted}` does not exist.", "model",
                           code="model_not_found")
        self._send_json(200, self._model_card())

    def _chat(self) -> None:
        body = self._body()
        self._log_unknown(body, CHAT_FIELDS)
        prompt_ids, params, shape = chat_request(self.server, body)
        outputs = self._answer(body, shape, [prompt_ids], params, parse_n(body), "messages")
        if outputs and self.server.next_turns is not None:
            self.server.next_turns.after_reply(body, outputs, shape)

    def _completions(self) -> None:
        body = self._body()
        self._log_unknown(body, COMPLETION_FIELDS)
        worker = self.server.worker
        request = parse_completion(body, worker, dataclasses.replace(
            self.server.sampling, max_tokens=self.server.completion_max_tokens))
        self._answer(body, CompletionShape(worker.engine.tokenizer, request), request.prompts,
                     request.params, request.n, "prompt")

    def _responses(self) -> None:
        post_response(self)

    def _stored_response(self) -> None:
        get_response(self)

    def _delete_response(self) -> None:
        delete_response(self)

    def _log_unknown(self, body: dict, known: frozenset[str]) -> None:
        """One log line naming the body's fields the API does not read (see unknown_fields), as
        vLLM's server logs them; their values, which may be long or private, are left out."""
        names = unknown_fields(body, known)
        if names:
            self.log_message("warning: %s %s: fields unknown to this server, ignored: %s",
                             self.command, self._route(), named(names))
