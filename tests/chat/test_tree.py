"""Conversation trees: edits and regenerations add branches, switching comes back to where a
branch was left, deleting removes only a subtree, everything survives reopening the file, a
message added to a long chat costs a few writes, not one per message above it, and a message
added under (or a reply saved into) one another process deleted is a clear error (or False) that
leaves nothing behind, a reply's token ids are kept with its text (and only with it), and a
renamed chat is named so for every process on the file."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest

from statechat.chat.tree import UNFINISHED, BusyError, GoneError, open_chats


def build(store):
    conv = store.create("hello")
    u1 = store.add(conv.id, None, "user", "first question")
    a1 = store.add(conv.id, u1.id, "assistant", "first answer")
    u2 = store.add(conv.id, a1.id, "user", "second question")
    a2 = store.add(conv.id, u2.id, "assistant", "second answer")
    return conv, u1, a1, u2, a2


def contents(store, conv_id):
    return [m.content for m in store.branch(conv_id)]


def test_edit_regenerate_switch_and_reopen(tmp_path):
    store = open_chats(tmp_path)
    conv, u1, a1, u2, _ = build(store)
    assert contents(store, conv.id) == ["first question", "first answer", "second question",
                                        "second answer"]
    # edit the first user message: a new root, the old branch kept
    e1 = store.add(conv.id, None, "user", "first question, edited")
    store.add(conv.id, e1.id, "assistant", "answer to the edit")
    assert contents(store, conv.id) == ["first question, edited", "answer to the edit"]
    assert [m.id for m in store.siblings(e1.id)] == [u1.id, e1.id]
    # regenerate the second answer on the old branch
    store.switch(e1.id, -1)
    assert contents(store, conv.id)[-1] == "second answer"
    r2 = store.add(conv.id, u2.id, "assistant", "second answer, again", stats={"cached_tokens": 64})
    assert [m.content for m in store.siblings(r2.id)] == ["second answer", "second answer, again"]
    # switching away and back returns to the branch as it was left
    store.switch(u1.id, 1)
    assert contents(store, conv.id)[0] == "first question, edited"
    store.switch(e1.id, -1)
    assert contents(store, conv.id)[-1] == "second answer, again"
    store.close()

    again = open_chats(tmp_path)
    assert [c.title for c in again.conversations()] == ["hello"]
    branch = again.branch(conv.id)
    assert (branch[-1].content == "second answer, again"
            and branch[-1].stats == {"cached_tokens": 64})
    assert again.path(a1.id)[-1].content == "first answer"
    again.close()


def test_delete_branch_keeps_the_rest(tmp_path):
    store = open_chats(tmp_path)
    conv, _, a1, u2, _ = build(store)
    r2 = store.add(conv.id, u2.id, "assistant", "other answer")
    # (what the app's question counts: every branch under a message)
    assert [store.num_under(m.id) for m in (a1, u2, r2)] == [3, 2, 0]
    store.delete_branch(r2.id)
    assert contents(store, conv.id)[-1] == "second answer"
    store.delete_branch(u2.id)  # removes u2 and a2
    assert contents(store, conv.id) == ["first question", "first answer"]
    assert store.children(a1.id) == []
    store.delete_conversation(conv.id)
    assert store.conversations() == []


def test_tables_are_prefixed_and_leave_others_alone(tmp_path):
    """The chats share the cache's index.db: their tables are apart, and the cache's rows stay
    (another program's file there is refused: tests/cli/test_commands.py)."""
    from statechat.cache.store import open_store

    open_store(tmp_path).close()
    db = sqlite3.connect(tmp_path / "index.db")
    db.execute("INSERT INTO models (fingerprint) VALUES ('abc')")
    db.commit()
    db.close()
    store = open_chats(tmp_path)
    build(store)
    cache_tables = {"models", "segments", "blocks", "checkpoints", "disk_budget"}
    names = set(store.db.table_names())
    assert {"chat_conversations", "chat_messages"} | cache_tables <= names
    assert all(n.startswith("chat_") for n in names - cache_tables)
    assert store.db.execute("SELECT fingerprint FROM models").fetchall() == [("abc",)]
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_changing_what_another_process_deleted_changes_nothing(tmp_path):
    store, other = open_chats(tmp_path), open_chats(tmp_path)
    conv, _, a1, u2, _ = build(store)
    assert store.update(a1.id, stats={"cached_tokens": 64})
    other.delete_branch(u2.id)
    with pytest.raises(GoneError, match="the message it answers or follows was deleted"):
        store.add(conv.id, u2.id, "assistant", "a reply to a deleted question")
    other.delete_conversation(conv.id)
    with pytest.raises(GoneError, match="the chat was deleted"):
        store.add(conv.id, None, "user", "a new root in a deleted chat")
    assert not store.update(a1.id, content="a reply finished after its chat was deleted")
    count = "SELECT count(*) FROM chat_messages"
    assert store.db.execute(count).fetchone() == (0,)  # (no row left half-added)
    other.close()
    store.close()


def test_what_another_process_deleted_is_gone(tmp_path):
    store, other = open_chats(tmp_path), open_chats(tmp_path)
    conv, u1, _, u2, _ = build(store)
    other.delete_branch(u2.id)
    assert store.find(u2.id) is None and store.find(u1.id) == u1
    other.delete_conversation(conv.id)
    assert not store.has_conversation(conv.id) and store.find(u1.id) is None
    other.close()
    store.close()


def test_a_long_chats_new_message_is_a_few_statements(tmp_path):
    store = open_chats(tmp_path)
    conv = store.create("long")
    parent = None
    for i in range(100):
        parent = store.add(conv.id, parent, "user" if i % 2 == 0 else "assistant", f"m{i}").id
    statements = []
    store.db.conn.set_trace_callback(statements.append)
    reply = store.add(conv.id, parent, "assistant", "one more")
    store.switch(reply.id, 0)
    store.db.conn.set_trace_callback(None)
    writes = [s for s in statements if s.split()[0].upper() in {"INSERT", "UPDATE", "COMMIT"}]
    assert len(writes) < 10, writes  # (it was an update and a commit per ancestor)
    assert [m.content for m in store.branch(conv.id)][-2:] == ["m99", "one more"]
    # every ancestor points at the path: a switch at the top comes back down it
    other = store.add(conv.id, None, "user", "another root")
    assert contents(store, conv.id) == ["another root"]
    store.switch(other.id, -1)
    assert contents(store, conv.id)[-1] == "one more"
    store.close()


def test_a_message_whose_stats_were_edited_into_bad_json_still_reads(tmp_path):
    """Stats are only shown: a row edited by hand (sqlite3, sqlite-utils) into something that
    is no JSON object reads as no stats, and the chat opens."""
    store = open_chats(tmp_path)
    conv = store.create("hello")
    u1 = store.add(conv.id, None, "user", "question")
    a1 = store.add(conv.id, u1.id, "assistant", "answer", stats={"reused": 64})
    u2 = store.add(conv.id, a1.id, "user", "again", stats={"reused": 0})
    store.close()
    db = sqlite3.connect(tmp_path / "index.db")
    with db:
        db.execute("UPDATE chat_messages SET stats = '{oops' WHERE id = ?", [a1.id])
        db.execute("UPDATE chat_messages SET stats = '[1, 2]' WHERE id = ?", [u2.id])
    db.close()
    store = open_chats(tmp_path)
    assert [(m.content, m.stats) for m in store.branch(conv.id)] == [
        ("question", {}), ("answer", {}), ("again", {})]


def test_a_reply_saved_as_it_streams_never_overwrites_its_end(tmp_path):
    """A streaming reply's text is saved as unfinished (a crash keeps it, and says so); once
    the reply is saved whole, a late save of its text so far changes nothing."""
    store = open_chats(tmp_path)
    conv = store.create("hello")
    user = store.add(conv.id, None, "user", "question")
    reply = store.add(conv.id, user.id, "assistant", "")
    assert store.save_unfinished(reply.id, "the start")
    assert store.save_unfinished(reply.id, "the start of it")
    reopened = open_chats(tmp_path)  # (another process, or the app after a crash)
    assert (reopened.message(reply.id).content, reopened.message(reply.id).stats) == (
        "the start of it", UNFINISHED)
    assert store.update(reply.id, content="the start of it, whole", stats={"ttft_s": 0.1})
    assert not store.save_unfinished(reply.id, "the start")
    assert (store.message(reply.id).content, store.message(reply.id).stats) == (
        "the start of it, whole", {"ttft_s": 0.1})


def test_a_call_after_close_is_not_called_damage(tmp_path):
    """A use of the chats after their close (a programming error, Python's ProgrammingError) is
    not a damaged file: telling the user to move sound chats away would lose them."""
    store = open_chats(tmp_path)
    store.create("hello")
    store.close()
    with pytest.raises(sqlite3.ProgrammingError):
        store.conversations()


def test_a_change_that_cannot_be_written_says_what_to_do(tmp_path):
    """BusyError's advice fits its cause: a full disk asks for room, a file that cannot be
    written for its mode asks to check it (both were told to free disk space or end what holds
    the file); an error that is no state of the file (a missing table) is not called busy."""
    chats = open_chats(tmp_path)
    conv = chats.create("t")
    pages = chats.db.execute("PRAGMA page_count").fetchone()[0]
    chats.db.execute(f"PRAGMA max_page_count = {pages}")
    with pytest.raises(BusyError, match=r"disk is full\); free some disk space") as full:
        chats.add(conv.id, None, "user", "x" * 100_000)
    assert "holds" not in str(full.value)
    chats.db.execute("PRAGMA max_page_count = 1073741823")
    chats.db.execute("PRAGMA query_only = 1")  # (SQLITE_READONLY, as a file made read-only)
    with pytest.raises(BusyError, match=r"readonly database\); check that .* can be written"):
        chats.add(conv.id, None, "user", "y")
    chats.db.execute("PRAGMA query_only = 0")
    chats.db.execute("ALTER TABLE chat_messages RENAME TO gone")
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        chats.add(conv.id, None, "user", "z")
    chats.close()


def test_records_import_without_the_sqlite3_error_code_names():
    """statechat.chat and the cache index import on Python 3.10, whose sqlite3 module has no
    SQLITE_FULL, SQLITE_CORRUPT, ... (pyproject allows it; the names came in 3.11): the
    chats' store failed to import there, through the index's error codes too."""
    code = ("import sqlite3\n"
            "for n in [n for n in dir(sqlite3) if n.startswith('SQLITE_')]:\n"
            "    delattr(sqlite3, n)\n"
            "import statechat.chat.records as r\nassert r.BUSY_ADVICE[13].startswith('free')\n"
            "import statechat.chat.tree, statechat.cache.index, statechat.cache.store")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_reply_s_token_ids_are_kept_with_its_text_and_only_with_it(tmp_path):
    """The ids a reply was made of come back after reopening the file; a text saved without
    them (as it streams, or by a caller that has none) leaves none, since the old ones are not
    its ids; a column edited by hand into something else reads as none."""
    store = open_chats(tmp_path)
    conv = store.create("hello")
    user = store.add(conv.id, None, "user", "question")
    reply = store.add(conv.id, user.id, "assistant", "")
    assert store.token_ids(user.id) is None and store.token_ids(reply.id) is None
    assert store.update(reply.id, content="an answer", stats={"ttft_s": 0.1},
                        token_ids=[276, 3, 90])
    store.close()
    store = open_chats(tmp_path)
    assert store.token_ids(reply.id) == [276, 3, 90]
    assert store.update(reply.id, stats={"ttft_s": 0.2})  # (stats alone: the ids stay)
    assert store.token_ids(reply.id) == [276, 3, 90]
    assert store.update(reply.id, content="another answer")
    assert store.token_ids(reply.id) is None
    assert store.update(reply.id, content="an answer", token_ids=[276, 3, 90])
    assert store.save_unfinished(reply.id, "an answer") is False  # (saved whole: untouched)
    other = store.add(conv.id, user.id, "assistant", "")
    store.update(other.id, content="x", token_ids=[5], stats=UNFINISHED)
    assert store.save_unfinished(other.id, "x and more") and store.token_ids(other.id) is None
    for edited in ("[1, -2]", "[1, true]", "{oops", '"7"', "[[1]]", f"[1, {2**40}]"):
        store.db.execute("UPDATE chat_messages SET token_ids = ? WHERE id = ?",
                         [edited, reply.id])
        assert store.token_ids(reply.id) is None, edited
    store.delete_branch(reply.id)
    assert store.token_ids(reply.id) is None


@pytest.mark.parametrize("edit", ["DELETE FROM chat_messages WHERE id = :leaf",
                                  "UPDATE chat_conversations SET current_leaf = NULL"])
def test_a_chat_whose_leaf_row_is_gone_reads_its_newest_branch(tmp_path, edit):
    """The current leaf's row deleted by hand (`sqlite3`: the last reply), or the chat's leaf
    set to NULL: the chat read as empty, every message of it hidden, and the next message sent
    began a new root. It reads as the branch of its newest message."""
    store = open_chats(tmp_path)
    conv, *_, a2 = build(store)
    other = store.create("another")
    store.add(other.id, None, "user", "another's newer question")
    with store.db.conn:
        store.db.execute(edit, {"leaf": a2.id})
    expected = ["first question", "first answer", "second question"]
    if "NULL" in edit:
        expected.append("second answer")
    assert contents(store, conv.id) == expected
    assert contents(store, other.id) == ["another's newer question"]
    assert contents(store, store.create("empty").id) == []


def test_places_are_each_message_s_among_its_siblings(tmp_path):
    """`places` (one query for a whole branch) gives what `siblings` gives message by message:
    a root's siblings are its chat's roots (another chat's are not), and a message deleted
    meanwhile is (1, 1)."""
    store = open_chats(tmp_path)
    conv, u1, a1, u2, a2 = build(store)
    other = store.create("other")
    store.add(other.id, None, "user", "another chat's root")
    store.add(conv.id, None, "user", "a second root")
    store.add(conv.id, a1.id, "user", "an edit")
    store.add(conv.id, u2.id, "assistant", "a regenerate")
    store.add(conv.id, u2.id, "assistant", "another")
    path = [u1, a1, u2, a2]
    expected = []
    for m in path:
        ids = [s.id for s in store.siblings(m.id)]
        expected.append((ids.index(m.id) + 1, len(ids)))
    assert expected == [(1, 2), (1, 1), (1, 2), (1, 3)]
    assert store.places(path) == expected
    store.delete_branch(a2.id)
    assert store.places(path) == [*expected[:3], (1, 1)]


def test_a_renamed_chat_keeps_its_name_and_place_for_every_process(tmp_path):
    """A chat renamed in one `statechat run` is named so after a reopen and in another process
    on the same file, keeps its place in the list (renaming is no new activity), and renaming
    one that another process deleted is False and changes nothing."""
    store, other = open_chats(tmp_path), open_chats(tmp_path)
    older, _, _, _, _ = build(store)
    newer = store.create("newer")
    assert store.rename(older.id, "Holiday plans")
    assert [c.title for c in other.conversations()] == ["newer", "Holiday plans"]
    other.delete_conversation(newer.id)
    assert not store.rename(newer.id, "too late")
    assert [c.title for c in store.conversations()] == ["Holiday plans"]
    store.close()
    other.close()
    reopened = open_chats(tmp_path)
    assert reopened.conversation(older.id).title == "Holiday plans"
    reopened.close()
