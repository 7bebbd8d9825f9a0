"""What a user can do that once crashed the app, lost their text or wrote to the wrong place:
an edit left open while another chat is opened or its message deleted, a message past the
context limit, a multi-line first message (the chat list's title), a pasted first line's
indent, deleting a chat while its reply streams, and a chat deleted by another statechat on
the same cache dir."""

from __future__ import annotations

import asyncio

from textual import events

from statechat.chat.tree import open_chats
from statechat.engine.sampling import SamplingParams
from statechat.tui.widgets.conversation_list import ConversationList
from tests.tui.test_app import make_app, views, wait_idle, wait_ready

LONG_REPLY = SamplingParams(max_tokens=4000, ignore_eos=True)


def notices(app) -> list[str]:
    return [n.message for n in app._notifications]


async def focus_message(pilot, app, index: int) -> None:
    views(app)[index].focus()
    await pilot.pause()


def test_titles_are_one_line_and_a_paste_keeps_its_first_indent(loaded, tmp_path):
    async def run():
        store = open_chats(tmp_path)
        store.create(title="an old\ntitle")  # as earlier versions stored a multi-line message
        store.close()
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            pasted = "    indented()\n        more()\n"
            await pilot.press("ctrl+n")  # (the old chat, empty, is open)
            app.post_message(events.Paste(pasted))
            await pilot.pause()
            await pilot.press("enter")
            await wait_idle(pilot, app)
            assert views(app)[0].message.content == "    indented()\n        more()"
            new, _ = app.chats.conversations()
            assert new.title == "indented() more()"
            labels = [str(label.render()) for label in app.query_one(ConversationList).query("Label")]
            assert labels == ["indented() more()", "an old title"]

    asyncio.run(run())
