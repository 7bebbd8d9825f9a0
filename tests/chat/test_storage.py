"""The chats' file: one made by an earlier statechat (before chat_messages had `token_ids`)
opens with its chats as they were, gains the column, and keeps working, also when another
process adds the column as this one opens it."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
import sqlite_utils

from statechat.chat.storage import BUSY_TIMEOUT_S
from statechat.chat.tree import BusyError, open_chats

# chat_messages as statechat made it before `token_ids`
OLD_MESSAGES = """CREATE TABLE chat_messages (id TEXT PRIMARY KEY, conversation_id TEXT
    REFERENCES chat_conversations(id), parent_id TEXT, role TEXT, content TEXT, created FLOAT,
    active_child TEXT, stats TEXT)"""
OLD_CONVERSATIONS = """CREATE TABLE chat_conversations (id TEXT PRIMARY KEY, title TEXT,
    created FLOAT, updated FLOAT, current_leaf TEXT)"""


def old_file(path) -> None:
    """A chats' file as an earlier statechat left it: one chat, a question and its answer."""
    db = sqlite3.connect(path / "index.db")
    db.execute("PRAGMA journal_mode=wal")  # (as statechat has always opened it)
    with db:
        db.execute(OLD_CONVERSATIONS)
        db.execute(OLD_MESSAGES)
        for column in ("conversation_id", "parent_id"):
            db.execute(f"CREATE INDEX idx_chat_messages_{column} ON chat_messages ({column})")
        db.execute("INSERT INTO chat_conversations VALUES ('c', 'old chat', 1, 1, 'a')")
        db.execute("INSERT INTO chat_messages VALUES ('u', 'c', NULL, 'user', 'question', 1, "
                   "'a', NULL)")
        db.execute("INSERT INTO chat_messages VALUES ('a', 'c', 'u', 'assistant', 'answer', 2, "
                   "NULL, NULL)")
    db.close()


def test_a_file_from_before_token_ids_opens_and_gains_them(tmp_path):
    old_file(tmp_path)
    store = open_chats(tmp_path)
    assert [m.content for m in store.branch("c")] == ["question", "answer"]
    assert store.token_ids("a") is None
    reply = store.add("c", "u", "assistant", "")
    assert store.update(reply.id, content="a new answer", token_ids=[1, 2])
    store.close()
    columns = [r[1] for r in sqlite3.connect(tmp_path / "index.db").execute(
        "PRAGMA table_info(chat_messages)")]
    assert columns[-1] == "token_ids"
    assert open_chats(tmp_path).token_ids(reply.id) == [1, 2]


def test_another_process_adding_the_column_first_is_as_good(tmp_path, monkeypatch):
    """Two statechat processes open an old file at once: both find the column missing, and the
    second's ALTER TABLE fails on a duplicate column, which is what it wanted (it ended the
    app); here the other process adds it between this one's look and its ALTER TABLE."""
    old_file(tmp_path)
    real = sqlite_utils.db.Table.add_column

    def other_process_first(self, name, *args, **kwargs):
        other = sqlite3.connect(tmp_path / "index.db")
        with other:
            other.execute(f"ALTER TABLE chat_messages ADD COLUMN {name} TEXT")
        other.close()
        return real(self, name, *args, **kwargs)  # (sqlite3.OperationalError: duplicate column)

    monkeypatch.setattr(sqlite_utils.db.Table, "add_column", other_process_first)
    store = open_chats(tmp_path)
    assert [m.content for m in store.branch("c")] == ["question", "answer"]
    reply = store.add("c", "u", "assistant", "")
    assert store.update(reply.id, content="a new answer", token_ids=[3])
    assert store.token_ids(reply.id) == [3]


def test_an_old_file_another_process_holds_locked_opens_at_once(tmp_path):
    """The column needs a write, which waits for another process's lock (a `sqlite3 index.db`
    shell inside BEGIN): the chats open at once all the same, as an earlier statechat opened
    them (each try of the open waited out SQLite's 30 s, some ten minutes in all), and their
    replies are saved without ids until an open finds the file free and adds the column."""
    old_file(tmp_path)
    other = sqlite3.connect(tmp_path / "index.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    opened: dict = {}
    thread = threading.Thread(target=lambda: opened.update(store=open_chats(tmp_path)),
                              daemon=True)
    thread.start()
    thread.join(20)
    other.execute("ROLLBACK")
    other.close()
    assert "store" in opened, "the chats were still opening after 20 s"
    store = opened["store"]
    assert [m.content for m in store.branch("c")] == ["question", "answer"]
    reply = store.add("c", "u", "assistant", "")
    assert store.save_unfinished(reply.id, "a new")
    assert store.update(reply.id, content="a new answer", token_ids=[1, 2])
    assert store.token_ids(reply.id) is None  # (no column to keep them in yet)
    store.close()
    store = open_chats(tmp_path)  # (the file free: the column comes)
    assert [m.content for m in store.branch("c")][-1] == "a new answer"
    assert store.update(reply.id, content="a new answer", token_ids=[1, 2])
    assert store.token_ids(reply.id) == [1, 2]
    store.close()


def test_the_chat_viewed_last_is_not_waited_for_while_another_process_holds_the_file(tmp_path):
    """Saving the chat viewed last (each chat opened, and the app's start) gives up within
    about a second, not the 30 s a chat's own write waits, and keeps the one saved before;
    writes after it wait as long as before."""
    chats = open_chats(tmp_path)
    first, second = chats.create("first").id, chats.create("second").id
    chats.set_last_viewed(first)
    other = sqlite3.connect(tmp_path / "index.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # (another process writing)
    began = time.monotonic()
    with pytest.raises(BusyError):
        chats.set_last_viewed(second)
    assert time.monotonic() - began < 10
    assert chats.db.execute("PRAGMA busy_timeout").fetchone()[0] == BUSY_TIMEOUT_S * 1000
    other.execute("ROLLBACK")
    assert chats.last_viewed() == first
    chats.set_last_viewed(second)
    assert open_chats(tmp_path).last_viewed() == second
