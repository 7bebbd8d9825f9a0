"""A chat or message that is gone (deleted here, or by another statechat process on the same
cache dir, between a check and its use) is one GoneError line naming it wherever the chats'
store is asked about it, not sqlite_utils' NotFoundError with no message, which the app showed
as a traceback; the rest of the chats go on as before."""

from __future__ import annotations

import pytest

from statechat.chat.tree import GoneError, open_chats


@pytest.fixture
def store(tmp_path):
    store = open_chats(tmp_path)
    yield store
    store.close()


def test_a_deleted_message_is_one_clear_line_to_every_call(store):
    conv = store.create("chat")
    q = store.add(conv.id, None, "user", "question")
    a = store.add(conv.id, q.id, "assistant", "answer")
    other = open_chats(store.file.parent)  # (another process's view of the file)
    other.delete_branch(a.id)
    calls = {"message": lambda: store.message(a.id), "siblings": lambda: store.siblings(a.id),
             "select": lambda: store.select(a.id), "switch": lambda: store.switch(a.id, 1),
             "delete_branch": lambda: store.delete_branch(a.id)}
    for name, call in calls.items():
        with pytest.raises(GoneError, match=f"^message {a.id} is gone") as info:
            call()
        assert "\n" not in str(info.value), name
    assert [m.content for m in store.branch(conv.id)] == ["question"]  # (the rest as before)
    other.close()


def test_a_deleted_chat_is_one_clear_line(store):
    conv = store.create("chat")
    store.add(conv.id, None, "user", "question")
    store.delete_conversation(conv.id)
    for call in (lambda: store.conversation(conv.id), lambda: store.branch(conv.id)):
        with pytest.raises(GoneError, match=f"^chat {conv.id} is gone"):
            call()
    assert store.conversations() == []
