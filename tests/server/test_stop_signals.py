"""What `statechat serve` shows when it is told to stop (api_serve.serve, with a stand-in
engine worker): the first SIGTERM or Ctrl-C says that it is stopping and how to quit at once
(a stop may wait long: for a client that does not read, for the cache's writes), and a second
signal while it stops ends it at once, saying that pending cache writes are lost, as a
KeyboardInterrupt (the CLI's exit status 130)."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import pytest

from statechat import api_serve


class StandInWorker:
    """An engine worker whose shutdown takes `stop_s` seconds (the cache's writes), or until
    a signal interrupts it."""

    def __init__(self, stop_s: float) -> None:
        self.stop_s, self.entered = stop_s, threading.Event()

    def shutdown(self, timeout: float | None = None) -> bool:
        self.entered.set()
        for _ in range(int(self.stop_s / 0.05)):  # (in slices: a signal that comes just
            threading.Event().wait(0.05)  # before a lock's wait is handled after it)
        return True


def _serve(worker: StandInWorker, signals: int) -> None:
    """api_serve.serve on a port of its own, sent SIGTERM `signals` times: the first once it
    serves (has answered a request), the second once its stop has begun."""
    sock = api_serve.bind("127.0.0.1", 0)

    def signal_it() -> None:
        # (until it answers a request: a connection alone is taken once the socket listens,
        # before the server is made and serves, where a signal is not yet its stop)
        host, port = sock.getsockname()[:2]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://{host}:{port}/health", timeout=10).close()
                break
            except OSError:
                threading.Event().wait(0.05)
        signal.pthread_kill(main, signal.SIGTERM)
        if signals > 1:
            assert worker.entered.wait(10)
            signal.pthread_kill(main, signal.SIGTERM)

    before, main = signal.getsignal(signal.SIGTERM), threading.main_thread().ident
    thread = threading.Thread(target=signal_it, daemon=True)
    thread.start()
    try:
        api_serve.serve(worker, "m", "127.0.0.1", 0, sock=sock)
    finally:
        signal.signal(signal.SIGTERM, before)
        thread.join(10)


def test_a_stop_says_so_and_how_to_quit_at_once(capsys):
    _serve(StandInWorker(0.1), signals=1)
    err = capsys.readouterr().err
    assert "statechat: stopping" in err and "Ctrl-C again quits at once" in err


def test_a_second_signal_while_it_stops_ends_it_at_once(capsys):
    with pytest.raises(KeyboardInterrupt):
        _serve(StandInWorker(30), signals=2)
    err = capsys.readouterr().err
    assert "statechat: stopped at once; cache writes still pending are lost" in err


def test_a_second_signal_as_the_stop_begins_ends_it_at_once(capsys, monkeypatch):
    """A second signal that lands as the first one's line prints (before the stop's wait) ends
    the stop at once too: it was taken in that moment, the stop then waited out the cache's
    writes, and only a third signal ended it."""
    real_print = print

    def print_then_signal(*args, **kwargs):
        real_print(*args, **kwargs)
        if str(args[0]).startswith("statechat: stopping"):
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(api_serve, "print", print_then_signal, raising=False)
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        _serve(StandInWorker(5), signals=1)
    assert time.monotonic() - began < 3
    err = capsys.readouterr().err
    assert "statechat: stopped at once; cache writes still pending are lost" in err
