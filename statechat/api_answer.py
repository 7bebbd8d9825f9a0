"""One API request's answer, chat or text completion alike (server.py's routes call it): its
choices submitted to the engine (api_choices.py), sent as one JSON response or streamed as
server-sent events (api_response.py's shapes), and, whatever happened, every choice still
running aborted and each one's reuse logged under the response's id (each is counted for
/metrics as it ends).

A client that goes away mid-answer aborts its choices (no traceback, the connection closed);
an error once a stream's headers are sent is reported inside the stream, before its `[DONE]`.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from statechat.api_choices import Choices, reuse_line
from statechat.api_http import JsonHandler
from statechat.api_request import ApiError, parse_stream
from statechat.api_response import Shape, response, stream_chunks
from statechat.engine.engine import RequestOutput
from statechat.engine.sampling import SamplingParams
from statechat.errors import ShuttingDownError

if TYPE_CHECKING:
    from statechat.server import ChatServer

ABORT_WAIT_S = 5  # how long a request left by its client waits for its choices' aborts (to log)


@dataclass
class Answering:
    """AnswerHandler.answering's word on an answer: whether its client went away."""

    gone: bool = False


def submit(server: ChatServer, prompts: list[list[int]], params: SamplingParams, n: int,
           param: str) -> Choices:
    """Choices.submit on the server's worker, each choice counted for /metrics as it ends (so
    a client that read its answer finds it counted), a server stopping being a 503 (not the
    request's fault; none ran)."""
    try:
        return Choices.submit(server.worker, prompts, params, n, param,
                              on_end=server.metrics.ended)
    except ShuttingDownError as e:
        raise ApiError(503, str(e), kind="server_error", code="shutting_down") from None


class AnswerHandler(JsonHandler):
    """JsonHandler's transport plus `_answer`, which the routes call with a parsed request.
    Its server has `worker` (an EngineWorker) and `model_id` besides JsonHandler's needs."""

    server: ChatServer

    def _answer(self, body: dict, shape: Shape, prompts: list[list[int]], params: SamplingParams,
                n: int, param: str) -> list[RequestOutput] | None:
        """Submit n choices per prompt and send them, whole or streamed; abort every choice
        still running when the client goes away. The outputs once all were sent, else None."""
        stream, include_usage = parse_stream(body)
        rid = f"{shape.id_prefix}-{uuid.uuid4().hex[:24]}"  # (the response's id; its log lines')
        choices = submit(self.server, prompts, params, n, param)
        head = {"id": rid, "created": int(time.time()), "model": self.server.model_id}
        with self.answering(choices, rid, stream) as answer:
            if stream:
                self._stream(shape, choices, head, include_usage)
            else:
                self._send_json(200, response(shape, head, choices.results(self._gone), n))
        if answer.gone:
            return None
        outputs = [handle.output for handle in choices.handles]
        return outputs if None not in outputs else None  # (None: a choice ended in an error)

    @contextlib.contextmanager
    def answering(self, choices: Choices, rid: str, stream: bool) -> Iterator[Answering]:
        """Around the sending of an answer (any API's): a client gone (a broken pipe, a reset,
        a timeout) closes the connection and sets `.gone`, no traceback; another failure is a
        500 naming it where no stream has begun, and goes up to the stream's own report where
        one has; whatever happened, each choice's reuse is logged and counted (_log_ended)."""
        answer = Answering()
        try:
            yield answer
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
            answer.gone = True
        except ApiError:
            raise
        except Exception as e:
            if stream:
                raise
            raise ApiError.internal(e) from None
        finally:
            self._log_ended(choices, rid)

    def _stream(self, shape: Shape, choices: Choices, head: dict, include_usage: bool) -> None:
        """Send the choices as server-sent events (`head` and each chunk's fields), a failure
        once the headers are out as an error event, then `data: [DONE]`; the connection then
        closes. A client that went away raises (BrokenPipeError and its kin)."""
        self.start_events()
        head = {**head, "object": shape.chunk_object}
        try:
            for chunk in stream_chunks(shape, choices, include_usage, self._gone):
                self.send_event({**head, **chunk})
        except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client is gone
            raise
        except Exception as e:  # noqa: BLE001 - headers are sent: report in the stream
            err = ApiError.internal(e)
            self.send_event(err.body())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def start_events(self) -> None:
        """Send the headers of a server-sent event stream (any API's); the connection closes
        after it."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def send_event(self, data: dict, name: str | None = None) -> None:
        """One server-sent event, flushed: `data` as JSON, after an `event: name` line where
        given (Anthropic's and the Responses API's streams name their events)."""
        line = f"event: {name}\n" if name else ""
        self.wfile.write(f"{line}data: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def _log_ended(self, choices: Choices | None, rid: str) -> None:
        """Abort the choices still running (a no-op for those that finished), then log the
        reuse of each once it has ended (an aborted one's marked so), under the response's id
        `rid` (a choice's index after it where there are several)."""
        if choices is not None:
            choices.abort()
            many = len(choices.handles) > 1
            for i, out in choices.ended(ABORT_WAIT_S):
                self.log_message("%s", reuse_line(out, f"{rid} choice {i}" if many else rid))
