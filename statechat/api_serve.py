"""The API server's process (`statechat serve`): a ChatServer served until Ctrl-C or SIGTERM,
its heap left out of the garbage collector's full collections meanwhile, then stopped."""

from __future__ import annotations

import contextlib
import gc
import sys

from statechat.engine.sampling import SamplingParams
from statechat.engine.worker import EngineWorker
from statechat.server import ChatServer


def serve(worker: EngineWorker, model_id: str, host: str, port: int, api_key: str | None = None,
          template_kwargs: dict | None = None, sampling: SamplingParams | None = None,
          completion_max_tokens: int | None = None, warm_next_turn: bool = True,
          allowed_origins: tuple[str, ...] = ("*",)) -> None:
    """Serve until Ctrl-C or SIGTERM, then stop the worker (flushing pending cache writes).
    `template_kwargs`, `sampling` and `completion_max_tokens` are the defaults of every
    request, `warm_next_turn` whether replies' next turns are computed, and `allowed_origins`
    the browsers' origins that may call it (ChatServer's)."""
    import signal

    def _stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    server = ChatServer(worker, model_id, host, port, api_key, template_kwargs=template_kwargs,
                        sampling=sampling, completion_max_tokens=completion_max_tokens,
                        warm_next_turn=warm_next_turn, allowed_origins=allowed_origins)
    auth = " (API key required)" if api_key else ""
    print(f"statechat: serving {model_id} at {server.url}/v1{auth}; Ctrl-C stops", file=sys.stderr)
    try:
        with frozen_heap():
            server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


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
