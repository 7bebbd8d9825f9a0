"""Where the chat stays while a reply streams: at its bottom, following the reply, while the box
or the reply has focus; still, while the user reads a message above (focused, in sight), which
the growing reply pushed out of sight; at the end of a continuation of a reply taller than the
chat, where its new text streams."""

from __future__ import annotations

import asyncio
import time

from statechat.chat.tree import open_chats
from statechat.config import EngineConfig
from statechat.engine.sampling import SamplingParams
from statechat.paths import EMBEDDED_MODEL
from statechat.tui.app import StatechatApp
from statechat.tui.widgets.chat_view import ChatView
from tests.tui.conftest import rest_between_steps
from tests.tui.test_app import settled, views, wait_ready
from tests.tui.test_edge_cases import start_long_reply

# as long as the embedded model's context allows: these tests take 15 s or more on a busy CI
# machine, and the reply must still be streaming at their end (4,000 tokens were not)
ENDLESS_REPLY = SamplingParams(max_tokens=8000, ignore_eos=True)


def long_reply_app(loaded, chat_dir) -> StatechatApp:
    """An app on `chat_dir` whose replies stream for longer than any test here runs."""
    return StatechatApp(EngineConfig(model=EMBEDDED_MODEL, device="cpu"), chat_dir,
                        loaded=loaded, sampling=ENDLESS_REPLY)


def grow_by_hand(monkeypatch) -> list:
    """The streamed text no longer reaches the screen of itself (the tiny model's text grows a
    few characters at a time); the list it returns gets the real `_show_text`, to show as
    much text as a test wants."""
    show = StatechatApp._show_text
    monkeypatch.setattr(StatechatApp, "_show_text", lambda self, reply_id, text: None)
    return [show]


async def grow(pilot, app, show, rows: int) -> None:
    """Show the streaming reply as `rows` rows of text; wait until the chat is laid out anew."""
    reply = views(app)[-1]
    show(app, app.streaming_reply_id, "\n\n".join(f"line {i}" for i in range(rows)))
    end = time.monotonic() + 30
    while reply.size.height < rows:
        assert time.monotonic() < end, "the reply's new text was never laid out"
        await pilot.pause(0.02)
    await pilot.pause()


def test_a_message_read_above_a_streaming_reply_stays_in_sight(loaded, tmp_path, monkeypatch):
    async def run():
        app = long_reply_app(loaded, tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            [show] = grow_by_hand(monkeypatch)
            await start_long_reply(pilot, app)
            await pilot.press("shift+tab")  # the reply: the chat follows it
            chat = app.query_one(ChatView)
            await grow(pilot, app, show, 4)  # (both messages in sight)
            await pilot.press("up")  # the message asked, in sight: the chat holds still
            asked = views(app)[0]
            await pilot.pause()
            await pilot.wait_for_scheduled_animations()
            assert app.focused is asked and app.screen.can_view_entire(asked)
            for rows in (30, 60):
                await grow(pilot, app, show, rows)
                assert app.screen.can_view_entire(asked), rows
            await pilot.press("down")  # the reply again, and its end: followed again
            await pilot.press("end")
            await grow(pilot, app, show, 80)
            assert chat.scroll_y == chat.max_scroll_y > 0
            assert app.handle is not None, "the reply ended before the test did"
            app.handle.abort()
            await pilot.pause(0.1)
            app.exit()

    asyncio.run(run())


def test_end_follows_the_reply_again_while_the_message_read_is_in_sight(loaded, tmp_path,
                                                                         monkeypatch):
    """End while the message read (focused) is still in sight at the chat's bottom, the reply
    short: the chat follows the reply again as it grows (it stayed, the message still in
    sight, and the reply's end went out of sight below)."""
    async def run():
        app = long_reply_app(loaded, tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            [show] = grow_by_hand(monkeypatch)
            await start_long_reply(pilot, app)
            await pilot.press("shift+tab", "up")  # the message asked, read
            asked = views(app)[0]
            chat = app.query_one(ChatView)
            await grow(pilot, app, show, 10)  # (the chat a few rows taller than the screen)
            assert chat.scroll_y == 0 < chat.max_scroll_y
            await pilot.press("end")
            await pilot.pause()
            assert app.focused is asked and chat.can_view_partial(asked)
            for rows in (30, 60):
                await grow(pilot, app, show, rows)
                assert chat.scroll_y == chat.max_scroll_y > 0, rows
            assert app.handle is not None, "the reply ended before the test did"
            app.handle.abort()
            await pilot.pause(0.1)
            app.exit()

    asyncio.run(run())


def test_a_continuation_of_a_long_reply_streams_in_sight(loaded, tmp_path, monkeypatch):
    """c on a reply taller than the chat: the continuation, focused, shows the reply's end,
    where its new text streams, and follows it as it grows (the chat showed the reply's top,
    the new text streaming out of sight below it)."""
    old = "\n\n".join(f"line {i}" for i in range(40))
    chats = open_chats(tmp_path)
    conv = chats.create("a long reply")
    asked = chats.add(conv.id, None, "user", "a long reply, please")
    chats.add(conv.id, asked.id, "assistant", old, stats={"finish_reason": "length"})
    chats.close()

    async def run():
        app = long_reply_app(loaded, tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            [show] = grow_by_hand(monkeypatch)
            await wait_ready(pilot, app)
            rest_between_steps(app)
            await pilot.press("shift+tab", "c")  # (the reply's own end: in sight)
            await settled(pilot, app)
            chat = app.query_one(ChatView)
            assert app.focused is views(app)[-1] and app.handle is not None
            assert chat.scroll_y == chat.max_scroll_y > 0
            reply = views(app)[-1]
            rows = reply.size.height
            show(app, app.streaming_reply_id, old + "\n\nnew line 1\n\nnew line 2")
            end = time.monotonic() + 30
            while reply.size.height < rows + 4:
                assert time.monotonic() < end, "the reply's new text was never laid out"
                await pilot.pause(0.02)
            await pilot.pause()
            assert chat.scroll_y == chat.max_scroll_y
            assert app.handle is not None, "the reply ended before the test did"
            app.handle.abort()
            await pilot.pause(0.1)
            app.exit()

    asyncio.run(run())
