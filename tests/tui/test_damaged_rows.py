"""Chats whose rows were edited by hand or by another program between runs (a title or a
content set to NULL, a role the app does not know, parents that loop) once kept the app from
starting (every chat unlisted, for one NULL title), ended it in Textual's traceback when such a
chat was opened, or hung it for good: each such chat now opens, showing what its rows hold, and
the others load and work as before."""

from __future__ import annotations

import asyncio
import threading

import pytest

from statechat.chat.tree import open_chats
from statechat.tui.widgets.composer import Composer
from statechat.tui.widgets.conversation_list import ConversationList
from tests.tui.test_app import header, make_app, send, settled, views, wait_idle, wait_ready

LOOP = ("UPDATE chat_messages SET parent_id = (SELECT id FROM chat_messages m WHERE "
        "m.conversation_id = chat_messages.conversation_id AND m.role = 'assistant') "
        "WHERE conversation_id = ? AND role = 'user'")  # (the user's message under its reply)


def edited_chats(chat_dir) -> dict[str, str]:
    """A sound chat and four whose rows were then edited by hand: {what was edited: chat id}."""
    chats = open_chats(chat_dir)
    ids = {}
    for name in ("sound", "null title", "tool role", "null content", "looping parents"):
        conv = chats.create(name)
        user = chats.add(conv.id, None, "user", f"{name} asks")
        chats.add(conv.id, user.id, "assistant", f"{name} replies")
        ids[name] = conv.id
    edits = [
        ("UPDATE chat_conversations SET title = NULL WHERE id = ?", "null title"),
        ("UPDATE chat_messages SET role = 'tool' WHERE conversation_id = ? AND role = 'assistant'",
         "tool role"),
        ("UPDATE chat_messages SET content = NULL WHERE conversation_id = ? AND role != 'user'",
         "null content"),
        (LOOP, "looping parents"),
    ]
    with chats.db.conn:
        for sql, name in edits:
            chats.db.execute(sql, [ids[name]])
    chats.close()
    return ids


def test_looping_parents_end_the_branch_rather_than_hang(tmp_path):
    """Parents that loop: reading the branch, selecting, counting and deleting under a message
    recursed for ever (SQLite, in the app's thread: the app hung)."""
    ids = edited_chats(tmp_path)
    chats = open_chats(tmp_path)
    done: list[object] = []

    def use():
        branch = chats.branch(ids["looping parents"])
        chats.select(branch[0].id)
        done.append([m.content for m in branch])
        done.append(chats.num_under(branch[0].id))
        chats.delete_branch(branch[0].id)
        done.append(chats.branch(ids["looping parents"]))

    thread = threading.Thread(target=use, daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), "the store hung on parents that loop"
    assert done[0] == ["looping parents asks", "looping parents replies"]
    assert done[1] == 1 and done[2] == []
    assert [m.content for m in chats.branch(ids["sound"])] == ["sound asks", "sound replies"]


def test_chats_with_rows_edited_by_hand_open_and_the_others_work(loaded, tmp_path):
    ids = edited_chats(tmp_path)
    chats = open_chats(tmp_path)  # (its parents no longer loop: the app's own test is above)
    with chats.db.conn:
        chats.db.execute("DELETE FROM chat_conversations WHERE id = ?", [ids["looping parents"]])
    chats.close()

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            assert app.is_running
            listed = app.query_one(ConversationList).conv_ids
            assert set(listed) == {ids[n] for n in ("sound", "null title", "tool role",
                                                    "null content")}
            assert app.chats.conversation(ids["null title"]).title == "(untitled)"
            app.open_conversation(ids["tool role"])
            await settled(pilot, app)
            assert app.is_running and header(views(app)[1]).startswith("tool")
            app.open_conversation(ids["null content"])
            await settled(pilot, app)
            assert app.is_running and [v.message.content for v in views(app)] == [
                "null content asks", ""]
            app.open_conversation(ids["sound"])
            await send(pilot, app, "and on")
            assert [v.message.content for v in views(app)][:3] == [
                "sound asks", "sound replies", "and on"]
            assert views(app)[3].message.stats.get("completion_tokens")

    asyncio.run(run())


FIRST_NO_USER_S = {  # a chat's first message made no user's, by hand
    "its role": ("UPDATE chat_messages SET role = 'assistant' WHERE id = ?", ["asks", "replies"]),
    "its user's row deleted": ("DELETE FROM chat_messages WHERE id = ?", ["replies"]),
}


@pytest.mark.parametrize("edit", FIRST_NO_USER_S)
def test_r_and_c_on_a_first_message_that_is_no_user_s_say_so(loaded, tmp_path, edit):
    """A chat whose first message is a reply or a system message (its role edited by hand, or
    written by another program; or its user's message deleted with `sqlite3`, the reply's
    parent now no row): r or c on it ended the app in a traceback (no message before it to
    answer again). They say what to pick, and the app goes on."""
    sql, shown = FIRST_NO_USER_S[edit]
    chats = open_chats(tmp_path)
    conv = chats.create("first is a reply")
    first = chats.add(conv.id, None, "user", "asks")
    chats.add(conv.id, first.id, "assistant", "replies")
    with chats.db.conn:
        chats.db.execute(sql, [first.id])
    chats.close()

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50), notifications=True) as pilot:
            await wait_ready(pilot, app)
            for key in ("r", "c"):
                views(app)[0].focus()
                await pilot.pause()
                await pilot.press(key)
                await pilot.pause(0.2)
                assert app.is_running and app.handle is None
                assert app._notifications and "Pick a reply" in list(app._notifications)[-1].message
            assert [v.message.content for v in views(app)] == shown

    asyncio.run(run())


def test_a_branch_with_a_role_no_template_takes_says_which_and_what_to_do(loaded, tmp_path):
    """A reply whose role was set by hand to one no chat template takes (NULL reads as
    `unknown`): every message sent after it got a reply whose error named roles and a message
    index the user never saw ("message 1 must be {'role': one of system/user/assistant, ...}").
    It names the message and its role, and how to go on; a branch edited around it works."""
    chats = open_chats(tmp_path)
    conv = chats.create("a role set by hand")
    first = chats.add(conv.id, None, "user", "asks")
    reply = chats.add(conv.id, first.id, "assistant", "replies")
    with chats.db.conn:
        chats.db.execute("UPDATE chat_messages SET role = NULL WHERE id = ?", [reply.id])
    chats.close()

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "and on")
            error = views(app)[-1].message.stats["error"]
            assert error.startswith("message 2 of this branch has the role 'unknown'"), error
            assert "(e)" in error
            app.query_one(Composer).start_edit(first.id, "asks again")
            await pilot.press("enter")
            await wait_idle(pilot, app)
            assert views(app)[0].message.content == "asks again"
            assert views(app)[-1].message.stats.get("completion_tokens")

    asyncio.run(run())
