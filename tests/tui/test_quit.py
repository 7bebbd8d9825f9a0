"""Quitting is prompt and loses nothing: Ctrl+Q on the loading screen stops the load after the
step under way (it went on to build the engine, on a GPU its graph capture, and the process
waited for all of it), and the app's close, a reply streaming, waits on no fixed interval (its
time is the engine's stop) while the reply is still kept."""

from __future__ import annotations

import asyncio
import threading
import time

from statechat.chat.tree import open_chats
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.model import loader
from statechat.paths import EMBEDDED_MODEL
from statechat.tui.app import StatechatApp
from tests.tui.test_edge_cases import quit_while_streaming


def test_quitting_while_the_model_loads_builds_no_engine(loaded, tmp_path, monkeypatch):
    apps: list[StatechatApp] = []
    built: list[LLMEngine] = []
    real_init = LLMEngine.__init__

    def load_model(*args, **kwargs):  # (a load that ends once the app is quitting)
        end = time.monotonic() + 30
        while not apps[0].is_closing and time.monotonic() < end:
            time.sleep(0.01)
        return loaded

    def init(self, *args, **kwargs):
        built.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(loader, "load_model", load_model)
    monkeypatch.setattr(LLMEngine, "__init__", init)

    async def run() -> None:
        apps.append(StatechatApp(EngineConfig(model=EMBEDDED_MODEL, device="cpu"), tmp_path))
        async with apps[0].run_test() as pilot:
            await pilot.pause(0.1)
            assert apps[0].screen.id == "loading"
            await pilot.press("ctrl+q")

    asyncio.run(run())  # (returns once the load's thread has ended)
    assert apps[0].is_closing and not built
    assert apps[0].worker is None and apps[0].chats is None


def test_an_engine_built_as_the_app_quits_is_stopped_by_the_load(loaded, tmp_path,
                                                                  monkeypatch):
    """The other order: the engine is being built when Ctrl+Q comes, so the app has none to
    stop; the load's thread stops the worker it made and opens no chats, and nothing is left
    running."""
    apps: list[StatechatApp] = []
    workers = []
    real_init = LLMEngine.__init__

    def init(self, *args, **kwargs):  # (a build that ends once the app is quitting)
        real_init(self, *args, **kwargs)
        end = time.monotonic() + 30
        while not apps[0].is_closing and time.monotonic() < end:
            time.sleep(0.01)

    from statechat.engine import worker as worker_module

    real_worker = worker_module.EngineWorker

    def worker(engine):
        workers.append(real_worker(engine))
        return workers[-1]

    monkeypatch.setattr(LLMEngine, "__init__", init)
    monkeypatch.setattr(worker_module, "EngineWorker", worker)

    async def run() -> None:
        apps.append(StatechatApp(EngineConfig(model=EMBEDDED_MODEL, device="cpu"), tmp_path,
                                 loaded=loaded))
        async with apps[0].run_test() as pilot:
            await pilot.pause(0.1)
            await pilot.press("ctrl+q")

    asyncio.run(run())
    assert len(workers) == 1 and not workers[0]._thread.is_alive()  # (stopped by the load)
    assert apps[0].worker is None and apps[0].chats is None


def test_closing_waits_on_no_fixed_interval(loaded, tmp_path, monkeypatch):
    """(QA timed about 2 s from Ctrl+Q to the shell's prompt: 0.2 s of it Textual's input
    thread, 1 s and more Python's teardown after the app returned, the app's own close a few
    milliseconds.)"""
    slept: list[float] = []
    real_sleep, real_unmount = time.sleep, StatechatApp.on_unmount

    def on_unmount(self) -> None:
        app_thread = threading.get_ident()

        def sleep(seconds: float) -> None:
            if threading.get_ident() == app_thread:
                slept.append(seconds)
            real_sleep(seconds)

        monkeypatch.setattr(time, "sleep", sleep)
        try:
            real_unmount(self)
        finally:
            monkeypatch.setattr(time, "sleep", real_sleep)

    monkeypatch.setattr(StatechatApp, "on_unmount", on_unmount)

    asyncio.run(quit_while_streaming(loaded, tmp_path))
    assert slept == []
    chats = open_chats(tmp_path)
    try:
        (conv,) = chats.conversations()
        reply = chats.branch(conv.id)[-1]
        assert reply.content and reply.stats["finish_reason"] == "abort"
    finally:
        chats.close()
