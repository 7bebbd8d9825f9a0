"""Quitting is prompt and loses nothing: Ctrl+Q on the loading screen stops the load after the
step under way (it went on to build the engine, on a GPU its graph capture, and the process
waited for all of it), and the app's close, a reply streaming, waits on no fixed interval (its
time is the engine's stop) while the reply is still kept. Ctrl+Q right after Enter, and keys
handled once the app is quitting, start nothing (the app crashed); SIGTERM and SIGHUP quit as
Ctrl+Q does, with exit status 128 + the signal's number; Ctrl+Q quits from the command
palette too."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
from textual import events
from textual.command import CommandPalette

from statechat.chat.tree import open_chats
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.model import loader
from statechat.paths import EMBEDDED_MODEL
from statechat.tui.app import StatechatApp
from statechat.tui.widgets.composer import Composer
from statechat.tui.widgets.conversation_list import ConversationList
from tests.tui.test_app import focus_message, make_app, send, wait_ready
from tests.tui.test_edge_cases import quit_while_streaming, reply_kept_stopped


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
    real_init, building = LLMEngine.__init__, threading.Event()

    def init(self, *args, **kwargs):  # (a build that ends once the app is quitting)
        building.set()
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
            end = time.monotonic() + 30
            while not building.is_set():  # (Ctrl+Q as the engine is being built)
                assert time.monotonic() < end, "the engine's build never began"
                await pilot.pause(0.05)
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


def test_ctrl_q_right_after_enter_exits_cleanly(loaded, tmp_path):
    """Keys queued together (typed ahead, or one tmux send-keys): the message was handled
    while the app was exiting and crashed it (MountError on the chat list, exit status 1). It
    exits with 0, and whatever was saved keeps its reply's text and stats."""
    async def run() -> StatechatApp:
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            app.query_one(Composer).set_text("hello")
            for key in ("enter", "ctrl+q"):  # (queued together: `pilot.press` waits between)
                app.post_message(events.Key(key, None))
            await pilot.pause(0.5)
        return app

    app = asyncio.run(run())  # (run_test raises what crashed the app)
    assert app.return_code == 0 and app.is_closed
    chats = open_chats(tmp_path)
    try:
        for conv in chats.conversations():
            assert all(m.stats for m in chats.branch(conv.id) if m.role == "assistant")
    finally:
        chats.close()


def test_ctrl_q_quits_from_the_command_palette(loaded, tmp_path):
    """The footer offers Ctrl+P's command palette; with it open, Ctrl+Q did nothing (the app's
    own Ctrl+Q had lost Textual's priority, and a modal screen holds back the rest)."""
    async def run() -> StatechatApp:
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await pilot.press("ctrl+p")
            await pilot.pause(0.2)
            assert isinstance(app.screen, CommandPalette)
            await pilot.press("ctrl+q")
            await pilot.pause(0.5)
            assert not app.is_running
        return app

    app = asyncio.run(run())
    assert app.return_code == 0 and app.is_closed


def test_keys_handled_while_quitting_start_nothing(loaded, tmp_path):
    """Once the app is quitting, sending, regenerating, editing, opening or deleting a chat
    and a new chat do nothing: they mounted widgets the exit was removing, or started a reply
    nobody would see."""
    async def run() -> StatechatApp:
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "first")
            conv, reply = app.conv_id, await focus_message(pilot, app, 1)
            before = [m.id for m in app.chats.branch(conv)]
            app.exit()
            app.action_regenerate(reply.message.id)
            app.action_edit_message(before[0])
            app.action_new_chat()
            app.action_delete_branch(reply.message.id)
            app.on_conversation_list_open(ConversationList.Open(conv))
            app.on_conversation_list_delete(ConversationList.Delete(conv))
            assert app.handle is None and app.conv_id == conv
            assert [m.id for m in app.chats.branch(conv)] == before
        return app

    app = asyncio.run(run())
    assert app.return_code == 0


def test_app_installs_quit_signals_in_the_main_thread(loaded, tmp_path):
    """SIGTERM and SIGHUP (where it exists) reach the app, not Python's default (the process
    killed, the reply lost, the terminal left in the alternate screen); none in another
    thread, where asyncio cannot take them."""
    async def run() -> tuple:
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            installed = app.quit_signals
        return app, installed

    app, installed = asyncio.run(run())
    assert signal.SIGTERM in installed
    assert (signal.SIGHUP in installed) == hasattr(signal, "SIGHUP")
    assert app.quit_signals == ()  # (removed as the app closed)
    result = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(run())[1]))
    thread.start()
    thread.join()
    assert result == [()]


@pytest.mark.parametrize("signum", [signal.SIGTERM, getattr(signal, "SIGHUP", None)])
def test_a_signal_quits_as_ctrl_q_does(loaded, tmp_path, signum):
    """`kill -TERM`, or the terminal closed (SIGHUP), while a reply streamed lost it (an empty
    reply with no stats): the app quits as Ctrl+Q does, the reply kept with a 'stopped'
    status, and exits with 128 + the signal's number (143, 129)."""
    if signum is None:
        pytest.skip("no SIGHUP on this platform")

    async def signal_it(app) -> None:
        assert signum in app.quit_signals
        os.kill(os.getpid(), signum)
        end = time.monotonic() + 5
        while not app.is_closing:  # (the handler runs on one of the loop's next turns)
            assert time.monotonic() < end, "the signal did not reach the app"
            await asyncio.sleep(0.01)

    async def second_run() -> None:
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            reply_kept_stopped(app)

    app = asyncio.run(quit_while_streaming(loaded, tmp_path, signal_it))
    assert app.return_code == 128 + signum and app.is_closed
    asyncio.run(second_run())
