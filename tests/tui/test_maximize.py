"""A message maximized (the command palette's Maximize, to read a long reply) comes back into
the chat as Textual's maximized widgets do: on Esc (Esc went to the app's stop, and the message
stayed maximized), and once the focus leaves it (Up from it focused a message not shown, and
`e` then edited it in a box not shown either)."""

from __future__ import annotations

import asyncio

from statechat.chat.tree import open_chats
from statechat.tui.widgets.composer import Composer
from tests.tui.test_app import make_app, views, wait_ready


def chat_of_two(chat_dir) -> None:
    """A chat of one message and its reply, in `chat_dir`."""
    chats = open_chats(chat_dir)
    conv = chats.create("read me")
    asked = chats.add(conv.id, None, "user", "a question")
    chats.add(conv.id, asked.id, "assistant", "an answer", stats={"finish_reason": "stop"})
    chats.close()


def test_esc_and_a_focus_move_bring_a_maximized_message_back(loaded, tmp_path):
    chat_of_two(tmp_path)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_ready(pilot, app)
            await pilot.press("shift+tab")  # the reply
            reply = views(app)[1]
            assert app.focused is reply
            app.screen.action_maximize()
            await pilot.pause()
            assert app.screen.maximized is reply
            await pilot.press("escape")
            assert app.screen.maximized is None and app.focused is reply
            app.screen.action_maximize()
            await pilot.pause()
            await pilot.press("up", "e")  # the message asked, edited in the box, all in sight
            assert app.screen.maximized is None
            assert app.focused is app.query_one(Composer)
            assert app.query_one(Composer).text == "a question"
            app.exit()

    asyncio.run(run())
