"""The API server's process (`statechat serve`): its socket bound before the model loads, a
ChatServer served on it until Ctrl-C or SIGTERM, its heap left out of the garbage collector's
full collections meanwhile, then stopped."""

from __future__ import annotations

import contextlib
import errno
import gc
import signal
import socket
import sys
import threading

from statechat.api_cors import LOCAL_ORIGINS
from statechat.engine.sampling import SamplingParams
from statechat.engine.worker import EngineWorker
from statechat.server import ChatServer

STOP_POLL_S = 0.1  # how often a stop under way looks for a second Ctrl-C or SIGTERM


class ListenError(OSError):
    """The server could not listen on its host and port (serve's; its errno and strerror are
    the OSError's), told apart from an OSError while it serves or stops."""


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, not listening yet, for `serve` (ChatServer's `sock`).
    `statechat serve` binds before the model loads, as vLLM's server does: a port in use, or
    an address this machine does not have, is an OSError at once rather than after a load of
    minutes, and while the model loads a client's connection is refused, not left hanging.
    The port is first bound alone (no SO_REUSEADDR: a second `serve` on it while this one
    loads is refused at once, where with it both bound the port and both loaded a model), and
    with SO_REUSEADDR only when that fails, for a stopped server's connections in TIME_WAIT.
    (A server that starts listening on the port meanwhile makes the listen an OSError.)"""
    try:
        return _bound(host, port, reuse=False)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
    return _bound(host, port, reuse=True)


def _bound(host: str, port: int, reuse: bool) -> socket.socket:
    """A socket bound to host:port (with SO_REUSEADDR if `reuse`), closed if it cannot be."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def serve(worker: EngineWorker, model_id: str, host: str, port: int, api_key: str | None = None,
          template_kwargs: dict | None = None, sampling: SamplingParams | None = None,
          completion_max_tokens: int | None = None, warm_next_turn: bool = True,
          allowed_origins: tuple[str, ...] = LOCAL_ORIGINS,
          sock: socket.socket | None = None, reasoning_parser: str | None = None,
          tool_call_parser: str | None = None,
          trust_request_chat_template: bool = False) -> None:
    """Serve until Ctrl-C or SIGTERM, then stop the worker (flushing pending cache writes).
    `template_kwargs`, `sampling` and `completion_max_tokens` are the defaults of every
    request, `warm_next_turn` whether replies' next turns are computed, and `allowed_origins`
    the browsers' origins that may call it, `reasoning_parser` what splits a chat reply's
    reasoning from its answer and `tool_call_parser` its tool calls, and
    `trust_request_chat_template` whether a request's own template is rendered (ChatServer's);
    `sock`: the socket `bind` made for host:port, else one is bound here. A ListenError when it
    cannot listen there."""
    signals = StopSignals()
    before = {n: signal.signal(n, signals.caught) for n in (signal.SIGTERM, signal.SIGINT)}
    try:
        _serve(worker, model_id, host, port, api_key, signals, sock=sock,
               template_kwargs=template_kwargs, sampling=sampling,
               completion_max_tokens=completion_max_tokens, warm_next_turn=warm_next_turn,
               allowed_origins=allowed_origins, reasoning_parser=reasoning_parser,
               tool_call_parser=tool_call_parser,
               trust_request_chat_template=trust_request_chat_template)
    finally:  # (SIGINT back to Python's KeyboardInterrupt, SIGTERM to what it was)
        for n, handler in before.items():
            signal.signal(n, handler)


def _serve(worker: EngineWorker, model_id: str, host: str, port: int, api_key: str | None,
           signals: StopSignals, sock: socket.socket | None, **server_kwargs) -> None:
    """`serve` once its signals are `signals`'s: the server made, served, stopped."""
    try:
        server = ChatServer(worker, model_id, host, port, api_key, sock=sock, **server_kwargs)
    except OSError as e:  # (another server took the port first: see bind)
        worker.shutdown()
        raise ListenError(e.errno, e.strerror) from None
    except BaseException:
        worker.shutdown()
        raise
    auth = " (API key required)" if api_key else ""
    try:  # (from here a signal stops the server: the worker with it)
        print(f"statechat: serving {model_id} at {server.url}/v1{auth}; Ctrl-C stops",
              file=sys.stderr)
        with frozen_heap():
            server.serve_forever()
    except KeyboardInterrupt:
        print("statechat: stopping: replies under way end with \"abort\", pending cache writes "
              "are flushed (Ctrl-C again quits at once)", file=sys.stderr)
    finally:
        _stop(server, signals)


class StopSignals:
    """Ctrl-C and SIGTERM while `serve` runs (`caught`, their handler): the first raises
    KeyboardInterrupt, which ends serve_forever; each later one sets `again`, which `_stop`
    looks at every STOP_POLL_S. (Raised too, a second one that landed before the stop's wait
    began, as its first line printed, was taken there: the stop then waited it all out. And a
    signal that lands just before a lock's wait begins is handled only when the wait ends.)"""

    def __init__(self) -> None:
        self.count = 0
        self.again = threading.Event()

    def caught(self, signum, frame) -> None:
        self.count += 1
        if self.count == 1:
            raise KeyboardInterrupt
        self.again.set()


def _stop(server: ChatServer, signals: StopSignals) -> None:
    """Stop the server (in a thread of its own, while this one waits for it); a second Ctrl-C
    or SIGTERM (`signals.again`, or a first one now, a KeyboardInterrupt) ends it at once, with
    a line saying what is lost, as a KeyboardInterrupt."""
    failed: list[BaseException] = []
    done = threading.Event()

    def stop() -> None:
        try:
            server.stop()
        except BaseException as e:  # noqa: BLE001 - raised again in the main thread
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=stop, name="statechat-stop", daemon=True).start()
    try:
        while not done.wait(STOP_POLL_S):
            if signals.again.is_set():
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        print("statechat: stopped at once; cache writes still pending are lost (the cache "
              "stays usable)", file=sys.stderr)
        raise
    if failed:
        raise failed[0]


@contextlib.contextmanager
def frozen_heap():
    """The objects alive on entry (torch's, transformers', triton's, the model's and the
    engine's: some 340,000) left out of the garbage collector's full collections until exit.
    Each full collection walks them all, some 100 ms during which every thread (the engine's
    step included) waits; what a request makes is collected as before."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # (so that they are freed at exit as usual)
