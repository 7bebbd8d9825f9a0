"""Renaming a chat: F2 (or n) on the chat list, or the command palette's `Rename chat`, asks
for the name in a small dialog holding the old one; Enter saves it (for every statechat on
the cache dir, after a restart too), Esc keeps the old one, an empty name is refused with a
notice and the dialog stays, and a chat another process deleted meanwhile is said to be
gone."""

from __future__ import annotations

import asyncio

from textual.widgets import Input

from statechat.chat.tree import open_chats
from statechat.tui.conversations import GONE
from statechat.tui.widgets.conversation_list import ConversationList
from statechat.tui.widgets.rename_dialog import RenameDialog
from tests.tui.palette import run_command
from tests.tui.test_app import make_app, screen_lines, wait_ready
from tests.tui.test_edge_cases import focus_message, notices


def seed(chat_dir) -> list[str]:
    """Two chats, "first" and then "second" (listed first); their ids, in that order."""
    chats = open_chats(chat_dir)
    ids = []
    for title in ("first", "second"):
        conv = chats.create(title)
        chats.add(conv.id, None, "user", f"in {title}")
        ids.append(conv.id)
    chats.close()
    return ids


def titles(chat_dir) -> list[str]:
    """The chats' titles as another process reads them, most recent first."""
    chats = open_chats(chat_dir)
    try:
        return [c.title for c in chats.conversations()]
    finally:
        chats.close()


async def type_name(pilot, app, name: str) -> None:
    """Type `name` over the dialog's text (it opens with the old name selected)."""
    assert isinstance(app.screen, RenameDialog)
    await pilot.press(*[("space" if c == " " else c) for c in name] or ["backspace"])


def test_f2_on_the_chat_list_renames_the_highlighted_chat(loaded, tmp_path):
    seed(tmp_path)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot, app)
            await pilot.press("ctrl+l")
            assert "f2 Rename" in screen_lines(app)[-1]
            await pilot.press("down", "f2")  # ("first", not the open one)
            await pilot.pause(0.1)
            assert app.screen.query_one(Input).value == "first"
            await type_name(pilot, app, "my trip")
            await pilot.press("enter")
            await pilot.pause(0.1)
            assert titles(tmp_path) == ["second", "my trip"]
            assert notices(app)[-1] == "Renamed the chat 'my trip'."
            chat_list = app.query_one(ConversationList)
            assert [title for _, title in chat_list.rows] == ["second", "my trip"]
            assert app.focused is chat_list and chat_list.index == 1
            await pilot.press("n")  # Esc keeps the name
            await type_name(pilot, app, "oops")
            await pilot.press("escape")
            await pilot.pause(0.1)
            assert not isinstance(app.screen, RenameDialog)
            assert titles(tmp_path) == ["second", "my trip"]
            await pilot.press("f2")
            await type_name(pilot, app, "")  # an empty name: refused, the dialog stays
            await pilot.press("space", "enter")
            await pilot.pause(0.1)
            assert isinstance(app.screen, RenameDialog)
            assert notices(app)[-1] == ("A chat needs a name: type one, or press Esc to keep "
                                        "'my trip'.")
            await type_name(pilot, app, "ok")
            await pilot.press("enter")
            await pilot.pause(0.1)
            assert titles(tmp_path) == ["second", "ok"]
            app.exit()

    asyncio.run(run())


def test_the_palette_renames_the_open_chat_unless_it_is_gone(loaded, tmp_path):
    first, second = seed(tmp_path)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_ready(pilot, app)
            assert app.conv_id == second
            await focus_message(pilot, app, 0)
            await run_command(pilot, app, "Rename chat")
            assert app.screen.query_one(Input).value == "second"
            await type_name(pilot, app, "renamed")
            await pilot.press("enter")
            await pilot.pause(0.1)
            assert titles(tmp_path) == ["renamed", "first"]
            await run_command(pilot, app, "Rename chat")
            other = open_chats(tmp_path)
            other.delete_conversation(second)  # (another statechat, while the dialog is up)
            other.close()
            await type_name(pilot, app, "too late")
            await pilot.press("enter")
            await pilot.pause(0.1)
            assert not isinstance(app.screen, RenameDialog)
            assert notices(app)[-1] == GONE.format("That chat")
            assert app.query_one(ConversationList).conv_ids == [first]
            assert titles(tmp_path) == ["first"]
            app.exit()

    asyncio.run(run())
