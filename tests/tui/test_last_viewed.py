"""A restart opens the chat viewed last (saved in the chats' file, table chat_state), not the
one updated last; where that chat was deleted, or none was saved (a file of an earlier
statechat), the one updated last, as before, with no error."""

from __future__ import annotations

import asyncio

from statechat.chat.tree import open_chats
from statechat.tui.widgets.conversation_list import ConversationList
from tests.tui.test_app import make_app, press_quit, views, wait_ready


def two_chats(chat_dir) -> tuple[str, str]:
    """An older chat and a newer one (updated last), each with one message: (older, newer)."""
    chats = open_chats(chat_dir)
    ids = []
    for title in ("older", "newer"):
        conv = chats.create(title)
        chats.add(conv.id, None, "user", f"{title} asks")
        ids.append(conv.id)
    chats.close()
    return ids[0], ids[1]


def started(loaded, chat_dir, then=None) -> str | None:
    """Start the app on `chat_dir`; the chat it shows first; `then(app)` (a coroutine
    function of the app and its pilot) runs before it quits."""
    first: list[str | None] = []

    async def run():
        app = make_app(loaded, chat_dir)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_ready(pilot, app)
            first.append(app.conv_id)
            assert [v.message.content for v in views(app)] == (
                [app.chats.branch(app.conv_id)[0].content] if app.conv_id else [])
            if then is not None:
                await then(app, pilot)
            await press_quit(pilot)

    asyncio.run(run())
    return first[0]


async def open_older(app, pilot) -> None:
    """Enter on the chat list's older chat (listed second)."""
    chat_list = app.query_one(ConversationList)
    chat_list.focus()
    chat_list.index = 1
    await pilot.press("enter")
    await pilot.pause()


def test_a_restart_opens_the_chat_viewed_last(loaded, tmp_path):
    older, newer = two_chats(tmp_path)
    assert started(loaded, tmp_path, then=open_older) == newer  # (none saved yet)
    assert started(loaded, tmp_path) == older
    assert open_chats(tmp_path).conversations()[0].id == newer  # (viewing changed no order)


def test_a_deleted_chat_viewed_last_falls_back_to_the_one_updated_last(loaded, tmp_path):
    older, newer = two_chats(tmp_path)
    started(loaded, tmp_path, then=open_older)
    chats = open_chats(tmp_path)
    assert chats.last_viewed() == older
    chats.delete_conversation(older)  # (another statechat, or the app itself)
    chats.close()
    assert started(loaded, tmp_path) == newer
    open_chats(tmp_path).delete_conversation(newer)
    assert started(loaded, tmp_path) is None  # (no chats: an empty one, as before)


def test_a_file_without_the_state_table_opens_the_one_updated_last(loaded, tmp_path):
    _, newer = two_chats(tmp_path)
    chats = open_chats(tmp_path)
    assert not chats.db["chat_state"].exists() and chats.last_viewed() is None
    chats.close()
    assert started(loaded, tmp_path) == newer
    assert open_chats(tmp_path).last_viewed() == newer


def test_a_chat_opened_again_after_another_statechat_opened_one_is_saved_again(loaded, tmp_path):
    """Two `statechat run` on one cache dir: a chat this one opens again, after the other one
    saved its own as viewed last, is the one a restart opens (it was taken as saved already)."""
    older, newer = two_chats(tmp_path)

    async def then(app, pilot):
        await open_older(app, pilot)
        other = open_chats(tmp_path)  # (the other statechat opens the newer chat)
        other.set_last_viewed(newer)
        await pilot.press("ctrl+n")
        await pilot.pause()
        await open_older(app, pilot)
        assert other.last_viewed() == older
        other.close()

    started(loaded, tmp_path, then=then)
    assert started(loaded, tmp_path) == older
