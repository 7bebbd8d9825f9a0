"""The engine's and the cache's warnings reach the user of the app: Python's logging wrote them
to standard error, which Textual takes while it draws and drops, so a cache dir whose disk
filled during a session said nothing (its checkpoints unsaved, no reuse after a restart). They
show as notices, and those logged as the app closes are kept for `statechat run` to print once
the terminal is its own again."""

from __future__ import annotations

import asyncio
import logging

from statechat.chat.tree import open_chats
from statechat.config import EngineConfig
from statechat.engine.sampling import SamplingParams
from statechat.paths import EMBEDDED_MODEL
from statechat.tui.app import StatechatApp
from tests.helpers import small_tmpfs
from tests.tui.test_app import long_text, make_app, send, views, wait_ready


def notices(app) -> list[str]:
    return [n.message for n in app._notifications]


def test_a_cache_dir_whose_disk_fills_says_so_in_a_notice(loaded, tmp_path):
    with small_tmpfs(tmp_path / "cache", "1M") as cache_dir:
        async def run():
            config = EngineConfig(model=EMBEDDED_MODEL, device="cpu", cache_dir=cache_dir)
            app = StatechatApp(config, tmp_path, loaded=loaded,
                               sampling=SamplingParams(max_tokens=40, ignore_eos=True))
            async with app.run_test(size=(120, 50), notifications=True) as pilot:
                await wait_ready(pilot, app)
                for i in range(6):
                    await send(pilot, app, long_text(i, 150))
                    await pilot.pause(0.3)  # (the cache's writer thread saves behind)
                    if any("could not persist" in n for n in notices(app)):
                        break
                full = [n for n in notices(app) if "could not persist" in n]
                assert full and "No space left on device" in full[0], notices(app)
                assert app.is_running and views(app)[-1].message.stats.get("completion_tokens")
            return app

        app = asyncio.run(run())
    assert app.log_notices not in logging.getLogger("statechat").handlers


def test_warnings_logged_as_the_app_closes_are_printed_after_it(loaded, tmp_path, capsys):
    """(`statechat run` runs the app with `run`, which gives the terminal back before it
    prints them: a notice would be drawn on a screen about to go.)"""
    line = "statechat cache: 3 more checkpoints could not be persisted (full)"

    async def quit_as_the_cache_warns(pilot):
        app = pilot.app
        await wait_ready(pilot, app)
        shutdown = app.worker.shutdown

        def warn_then_shutdown(*args, **kwargs):
            logging.getLogger("statechat.cache").warning(line)
            return shutdown(*args, **kwargs)

        app.worker.shutdown = warn_then_shutdown
        await pilot.press("ctrl+q")

    app = make_app(loaded, tmp_path)
    app.run(headless=True, size=(120, 50), auto_pilot=quit_as_the_cache_warns)
    assert app.return_code == 0 and app.log_notices.late == [line]
    assert capsys.readouterr().err.splitlines()[-1:] == [line]


def test_a_reply_that_cannot_be_saved_as_the_app_quits_is_said_after_it(loaded, tmp_path,
                                                                         monkeypatch):
    """Ctrl+Q while a reply streams, the chats' file full (its stop could not be saved): it was
    dropped unsaid. A line says so once the app has closed, and what was saved as it streamed
    is there at the next start, marked unfinished."""
    from statechat.chat.tree import BusyError
    from statechat.tui import replies
    from tests.tui.test_edge_cases import long_reply_app, start_long_reply

    monkeypatch.setattr(replies, "SAVE_INTERVAL_S", 0.05)

    async def run():
        app = long_reply_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await start_long_reply(pilot, app)
            reply_id = app.streaming_reply_id
            while not app.chats.message(reply_id).content:
                await pilot.pause(0.05)

            def full(*args, **kwargs):
                raise BusyError("the chats in X could not be saved (database or disk is full); "
                                "free some disk space and try again")

            monkeypatch.setattr(app.chats, "update", full)
            await pilot.press("ctrl+q")
        return app, reply_id

    app, reply_id = asyncio.run(run())
    assert len(app.log_notices.late) == 1, app.log_notices.late
    assert app.log_notices.late[0].startswith("statechat: the reply streaming as the app quit "
                                              "was not saved (the chats in X could not be saved")
    kept = open_chats(tmp_path).message(reply_id)
    assert kept.content and kept.stats == {"unfinished": True}


def test_a_flood_of_warnings_shows_a_few_notices_and_prints_the_rest_after(loaded, tmp_path,
                                                                           capsys):
    """A failing disk can warn hundreds of times a second, from the cache's threads: each was a
    notice of its own, and Textual mounting thousands of them held the app for seconds (12 s
    for 1,500). A line already showing is not shown again; past a few at once, the lines are
    held (one notice says so) and printed after the app, each once with its count."""
    import threading

    from statechat.tui.log_notices import MAX_NOTICES

    async def flood(pilot):
        app = pilot.app
        await wait_ready(pilot, app)
        log = logging.getLogger("statechat.cache")

        def warn():
            for i in range(1500):
                log.warning("statechat cache: the same failure")
                log.warning("statechat cache: failure %d", i % 40)

        thread = threading.Thread(target=warn)
        thread.start()
        thread.join()
        await pilot.pause()
        shown.extend(notices(app))
        await send(pilot, app, "still there")
        assert views(app)[-1].message.stats.get("completion_tokens")
        await pilot.press("ctrl+q")

    shown: list[str] = []
    app = make_app(loaded, tmp_path)
    app.run(headless=True, size=(120, 50), auto_pilot=flood)
    assert app.return_code == 0
    assert len(shown) <= MAX_NOTICES + 1 and shown.count("statechat cache: the same failure") == 1
    assert any("printed when statechat quits" in n for n in shown), shown
    printed = [line for line in capsys.readouterr().err.splitlines() if "failure" in line]
    late = app.log_notices.late
    assert set(late) <= set(printed) and len(late) == len(set(late)) <= 40
    held = {f"statechat cache: failure {i} (x{len(range(i, 1500, 40))})"  # (those past the
            for i in range(MAX_NOTICES - 1, 40)}  # first notices, "the same failure"'s one)
    assert held <= set(late)
    assert logging.getLogger("statechat").handlers == []


def test_an_app_whose_close_fails_leaves_no_handler_behind(loaded, tmp_path):
    """The notices' handler stayed on the `statechat` logger when the app's close raised (an
    engine whose shutdown failed): it held the closed app (its engine, its model) for the rest
    of the process, and kept every later warning of another app run in it."""
    async def close_fails(pilot):
        await wait_ready(pilot, pilot.app)

        def fails(*args, **kwargs):
            raise RuntimeError("the engine's shutdown failed")

        pilot.app.worker.shutdown = fails
        await pilot.press("ctrl+q")

    first = make_app(loaded, tmp_path)
    try:
        first.run(headless=True, size=(120, 50), auto_pilot=close_fails)
    except RuntimeError:
        pass
    assert logging.getLogger("statechat").handlers == []

    async def second():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50), notifications=True) as pilot:
            await wait_ready(pilot, app)
            logging.getLogger("statechat.engine").warning("statechat: the second app's")
            await pilot.pause(0.1)
            assert notices(app) == ["statechat: the second app's"]

    asyncio.run(second())
    assert first.log_notices.late == [] and logging.getLogger("statechat").handlers == []
