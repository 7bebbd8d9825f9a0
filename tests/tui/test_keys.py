"""Keys go on doing what they did: after a regenerate or a deleted branch the focus stays on
the message shown in its place (it fell to the chat list, where `r` did nothing and Delete
deleted the whole chat), Esc cancels an edit before it stops a reply, the chat list,
focused, highlights a chat so that Enter opens it (and keeps the one the user highlighted when a
reply ends), Up and Down move one message a key however fast they come, a paste made with a
message or the chat list focused lands in the message box (it was dropped), and Delete on the
chat list and d on a message ask before they delete (the key again deletes)."""

from __future__ import annotations

import asyncio
import time

from textual import events

from statechat.chat.tree import open_chats
from statechat.tui import conversations
from statechat.tui.conversations import GONE
from statechat.tui.widgets.composer import Composer
from statechat.tui.widgets.conversation_list import ConversationList
from tests.tui.test_app import (
    header,
    make_app,
    send,
    settled,
    status,
    views,
    wait_idle,
    wait_ready,
)
from tests.tui.test_edge_cases import focus_message, long_reply_app, notices, start_long_reply


def test_focus_stays_on_the_reply_after_regenerate_and_delete(loaded, tmp_path):
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "hello")
            await pilot.press("shift+tab", "r")  # the reply, regenerated
            await wait_idle(pilot, app)
            assert app.focused is views(app)[1] and "2/2" in header(views(app)[1])
            await pilot.press("r")  # again: `r r` regenerates twice
            await wait_idle(pilot, app)
            assert app.focused is views(app)[1] and "3/3" in header(views(app)[1])
            await pilot.press("up")
            assert app.focused is views(app)[0]
            await pilot.press("down", "d", "d")  # the sibling shown instead is focused
            await settled(pilot, app)
            assert app.focused is views(app)[1] and "2/2" in header(views(app)[1])
            await pilot.press("delete")  # (on the chat list, it deleted the chat)
            assert len(app.chats.conversations()) == 1
            text = header(views(app)[1])  # a click on `regenerate` focuses the new reply too
            link = (text.index("regenerate") + 2, 0)
            await pilot.click(views(app)[1].query_one(".header"), offset=link)
            await wait_idle(pilot, app)
            assert app.focused is views(app)[1] and "3/3" in header(views(app)[1])
            for _ in range(3):  # the last reply deleted: its message is focused
                await pilot.press("d", "d")
                await settled(pilot, app)
            assert len(views(app)) == 1 and app.focused is views(app)[0]

    asyncio.run(run())


def test_esc_cancels_an_edit_before_it_stops_a_reply(loaded, tmp_path):
    async def run():
        app = long_reply_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await start_long_reply(pilot, app)
            composer = app.query_one(Composer)
            composer.set_text("a draft")
            await focus_message(pilot, app, 0)
            await pilot.press("e")
            assert composer.editing and app.handle is not None
            await pilot.press("escape")
            assert composer.editing is None and composer.border_title is None
            assert composer.text == "a draft" and app.handle is not None  # still streaming
            await pilot.press("escape")
            await wait_idle(pilot, app)
            assert "stopped" in status(views(app)[1])

    asyncio.run(run())


def test_the_chat_list_focused_highlights_a_chat(loaded, tmp_path):
    """Ctrl+N, Ctrl+L, Enter opened nothing: no chat was highlighted."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "chat a")
            chat_a = app.conv_id
            await pilot.press("ctrl+n", "ctrl+l", "enter")
            await pilot.pause(0.1)
            assert app.conv_id == chat_a
            assert views(app)[0].message.content == "chat a"

    asyncio.run(run())


def test_ctrl_l_lists_the_chats_another_process_started(loaded, tmp_path):
    """Another `statechat run` on the same cache dir starts a chat: Ctrl+L showed the list as
    it was read last (an empty one: Enter opened nothing), until some chat was opened."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            other = open_chats(tmp_path)
            conv = other.create("from the other one")
            other.add(conv.id, None, "user", "written elsewhere")
            other.close()
            await pilot.press("ctrl+l")
            await pilot.pause(0.1)
            assert app.query_one(ConversationList).conv_ids == [conv.id]
            await pilot.press("enter")
            await pilot.pause(0.1)
            assert app.conv_id == conv.id
            assert views(app)[0].message.content == "written elsewhere"

    asyncio.run(run())


def test_a_paste_lands_in_the_box_from_wherever_the_focus_is(loaded, tmp_path):
    """A message and the chat list take no text, so a paste made while one of them had focus
    was lost. It now goes into the box at its cursor, the box focused, as Ctrl+O then the
    paste would (test_app's paste into the box shows it is not doubled)."""

    async def run(size):
        app = make_app(loaded, tmp_path / f"{size[0]}")
        async with app.run_test(size=size) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "hello")
            composer, chats = app.query_one(Composer), app.query_one(ConversationList)
            composer.set_text("draft ")
            await focus_message(pilot, app, 1)
            app.post_message(events.Paste("one\ntwo"))  # (as the terminal driver delivers it)
            await pilot.pause()
            assert app.focused is composer and composer.text == "draft one\ntwo"
            await pilot.press("ctrl+l")
            app.post_message(events.Paste(" three"))
            await pilot.pause()
            assert app.focused is composer and composer.text == "draft one\ntwo three"
            assert app.query_one("#main").display and chats.display == (size[0] >= 50)

    for size in ((120, 50), (40, 12)):  # (the narrow one shows the chat list in the chat's place)
        asyncio.run(run(size))


def test_a_reply_ending_leaves_the_chat_list_s_highlight_alone(loaded, tmp_path):
    """Browsing the chat list while a reply streams: its end moved the highlight to its own
    chat, and the Delete meant for the chat highlighted deleted that one instead."""
    async def run():
        app = long_reply_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await start_long_reply(pilot, app)
            first = app.conv_id
            app.handle.abort()
            await wait_idle(pilot, app)
            await pilot.press("ctrl+n")
            await start_long_reply(pilot, app)  # a second chat, its reply streaming
            await pilot.press("ctrl+l")
            await pilot.pause(0.1)
            await pilot.press("down")  # the first chat highlighted
            await pilot.pause(0.1)
            app.handle.abort()  # the reply ends while the user is in the list
            await wait_idle(pilot, app)
            await pilot.pause(0.1)
            await pilot.press("delete", "delete")
            await pilot.pause(0.1)
            assert [c.id for c in app.chats.conversations()] == [app.conv_id]
            assert app.conv_id != first

    asyncio.run(run())


def test_up_pressed_fast_moves_one_message_a_key(loaded, tmp_path):
    """Keys that arrive together (a held Up, fast typing) each move the focus one message: they
    all moved it from the same message, which Textual had not focused yet."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            for text in ("one", "two", "three"):
                await send(pilot, app, text)
            await pilot.press("shift+tab")
            assert app.focused is views(app)[5]
            for _ in range(4):  # (queued before the first is handled, as a terminal sends them)
                app._driver.send_message(events.Key("up", None))
            end = time.monotonic() + 10  # (a loaded machine handles them some frames later)
            while app.focused is not views(app)[1] and time.monotonic() < end:
                await pilot.pause(0.05)
            await pilot.pause(0.1)  # (and no further)
            assert app.focused is views(app)[1]

    asyncio.run(run())


def test_a_key_on_a_message_another_process_deleted_leaves_the_chat_shown(loaded, tmp_path):
    """e, r, c, ] or d on a message another statechat deleted says so, once (a second notice
    told the user to pick a reply, as though they had picked the wrong one), and the focus
    goes to the box: it fell to the chat list, which on a narrow terminal then filled the
    screen in place of the chat, and where Delete deletes the whole chat."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(40, 30)) as pilot:  # (narrow: the list shows if focused)
            await wait_ready(pilot, app)
            for key, index in (("c", 1), ("r", 1), ("e", 0), ("right_square_bracket", 1),
                               ("d", 1)):
                await send(pilot, app, f"before {key}")
                other = open_chats(tmp_path)
                other.delete_branch(views(app)[index].message.id)
                other.close()
                await focus_message(pilot, app, index)
                app.clear_notifications()
                await pilot.press(key)
                await pilot.pause(0.1)
                assert notices(app) == [GONE.format("That message")], key
                assert app.focused is app.query_one(Composer), key
                assert app.query_one("#main").display, key  # (the chat, not the list)

    asyncio.run(run())


def test_delete_on_the_chat_list_asks_first(loaded, tmp_path, monkeypatch):
    """One Delete on the chat list removed the whole chat, with no undo: now it asks, naming
    the chat, and Delete again deletes it; the question lapses when the highlight moves or
    after CONFIRM_S."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "chat a")
            await pilot.press("ctrl+n")
            await send(pilot, app, "chat b")
            await pilot.press("ctrl+l", "delete")  # (chat b, the open one, highlighted)
            await pilot.pause(0.1)
            assert len(app.chats.conversations()) == 2
            assert notices(app)[-1].startswith("Delete chat 'chat b' and all its messages?")
            await pilot.press("delete")
            await pilot.pause(0.1)
            assert [c.title for c in app.chats.conversations()] == ["chat a"]
            assert notices(app)[-1] == "Chat 'chat b' deleted."
            # asked, then the highlight moved away and back: Delete asks again
            await send(pilot, app, "chat c")
            await pilot.press("ctrl+l", "delete", "down", "up")
            await pilot.pause(0.1)
            await pilot.press("delete")
            await pilot.pause(0.1)
            assert len(app.chats.conversations()) == 2
            assert notices(app)[-1].startswith("Delete chat 'chat c'")
            # asked, and left to lapse: Delete asks again
            monkeypatch.setattr(conversations, "CONFIRM_S", 0.2)
            await pilot.pause(0.3)
            await pilot.press("delete")
            await pilot.pause(0.1)
            assert len(app.chats.conversations()) == 2
            monkeypatch.setattr(conversations, "CONFIRM_S", 5.0)  # (this one does not lapse)
            await pilot.press("delete")
            await pilot.pause(0.1)
            assert [c.title for c in app.chats.conversations()] == ["chat a"]

    asyncio.run(run())


def test_d_asks_before_deleting_a_branch(loaded, tmp_path):
    """d removed a message and everything under it at once: now it asks, saying how much goes,
    and d again deletes; moving to another message in between asks again."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "hello")
            await send(pilot, app, "again")
            await focus_message(pilot, app, 0)
            await pilot.press("d")
            await pilot.pause(0.1)
            assert len(views(app)) == 4
            assert notices(app)[-1] == ("Delete this message and the 3 messages under it "
                                        "(every branch)? Press d again to delete.")
            await pilot.press("down", "up", "d")  # (moved away and back: asked again)
            await pilot.pause(0.1)
            assert len(views(app)) == 4
            await pilot.press("down", "down", "down", "d")
            await pilot.pause(0.1)
            assert notices(app)[-1] == "Delete this reply? Press d again to delete."
            await pilot.press("d")
            await pilot.pause(0.1)
            assert len(views(app)) == 3 and notices(app)[-1] == "Branch deleted."

    asyncio.run(run())
