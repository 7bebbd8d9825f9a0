"""scripts/bench_tui_switch.py ends: its quit returns, and the app closes (the engine stopped),
where the app starts an animation after its loop has ended (the scroll to a message just
focused, queued before the quit: the bench hung, idle, at its end, now and then on a busy
machine). Textual's `pilot.press("ctrl+q")` waits for that animation, which never completes."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util

from statechat.config import EngineConfig
from statechat.paths import EMBEDDED_MODEL
from statechat.tui.app import StatechatApp
from statechat.tui.widgets.chat_view import ChatView
from tests.helpers import ROOT
from tests.tui.test_app import wait_ready

QUIT_S = 10  # the quit returns well within this


def bench_script():
    """scripts/bench_tui_switch.py, imported from the script file."""
    spec = importlib.util.spec_from_file_location("bench_tui_switch",
                                                  ROOT / "scripts" / "bench_tui_switch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quit_with_an_animation_started_after_the_loop_ended(loaded, tmp_path, monkeypatch):
    bench = bench_script()
    bench.long_chat(tmp_path, 40)
    app = StatechatApp(EngineConfig(model=EMBEDDED_MODEL, device="cpu"), tmp_path, loaded=loaded)
    returned = []

    async def run():
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            chat = app.query_one(ChatView)
            top = chat.views()[2]
            assert not app.screen.can_view_entire(top)  # (a scroll to it moves the chat)
            stopped = asyncio.Event()
            stop = app.animator.stop

            async def stop_and_say() -> None:
                await stop()
                stopped.set()

            async def scroll_once_stopped() -> None:
                """(The screen's queue, held until the app's loop has ended) what focusing
                `top` queues on the screen (Screen.set_focus): an animated scroll to it."""
                with contextlib.suppress(TimeoutError):  # (a quit that never came: no hang)
                    await asyncio.wait_for(stopped.wait(), 2 * QUIT_S)
                app.screen.scroll_to_center(top, origin_visible=True, immediate=True)

            monkeypatch.setattr(app.animator, "stop", stop_and_say)
            app.screen.call_later(scroll_once_stopped)
            await asyncio.wait_for(bench.quit_app(pilot), QUIT_S)
            returned.append(True)

    asyncio.run(run())
    assert returned and app.is_closed
