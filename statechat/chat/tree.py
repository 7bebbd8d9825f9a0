"""Conversation trees in SQLite: every message keeps its parent, so nothing an edit replaces is
lost.

A conversation is a tree of messages; the branch on screen is the path from a root to the
conversation's `current_leaf`. Editing a message adds a sibling (a new branch from its parent),
regenerating a reply adds a sibling reply, and so does continuing one (the reply's text and the
token ids it was made of, kept with it, are where a continuation begins); switching siblings
follows each message's `active_child` down to a leaf, so a branch comes back as it was left.

The tables, in `<cache_dir>/index.db`, and how the file opens are storage.py's; the records
and errors it gives are records.py's; reading and moving along branches is branches.py's.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from statechat.chat.branches import ChatBranches
from statechat.chat.records import (
    UNFINISHED,
    BusyError,
    Conversation,
    DamagedError,
    GoneError,
    Message,
)
from statechat.chat.storage import CONVERSATIONS, MESSAGES

GONE = "{what} {id} is gone (deleted, here or by another statechat process on this cache dir)"

# (the store's callers import its records and errors from here, as before storage.py)
__all__ = ["UNFINISHED", "BusyError", "ChatStore", "Conversation", "DamagedError", "GoneError",
           "Message", "open_chats"]


def _new_id() -> str:
    return uuid.uuid4().hex[:16]


class ChatStore(ChatBranches):
    """Conversation trees persisted in one SQLite file (storage.py); safe to call from several
    threads."""

    # --- conversations ------------------------------------------------------------------
    def conversations(self) -> list[Conversation]:
        """All conversations, most recently updated first."""
        with self._locked():
            rows = self.db[CONVERSATIONS].rows_where(order_by="updated desc")
            return [Conversation.of_row(r) for r in rows]

    def has_conversation(self, conv_id: str) -> bool:
        """False once it is deleted (here, or by another process on the same file)."""
        with self._locked():
            return self.db[CONVERSATIONS].count_where("id = ?", [conv_id]) > 0

    def conversation(self, conv_id: str) -> Conversation:
        """The chat `conv_id`; GoneError once it is deleted."""
        with self._locked():
            return Conversation.of_row(self._row(CONVERSATIONS, conv_id))

    def _row(self, table: str, key: str) -> dict:
        """The row of `table` whose id is `key`; GoneError, naming it, where there is none (a
        deletion, here or by another process, between a caller's check and this use)."""
        rows = list(self.db[table].rows_where("id = ?", [key]))
        if not rows:
            what = "chat" if table == CONVERSATIONS else "message"
            raise GoneError(GONE.format(what=what, id=key))
        return rows[0]

    def create(self, title: str = "New chat") -> Conversation:
        now = time.time()
        row = {"id": _new_id(), "title": title, "created": now, "updated": now,
               "current_leaf": None}
        with self._locked():
            self.db[CONVERSATIONS].insert(row)
        return Conversation(**row)

    def rename(self, conv_id: str, title: str) -> bool:
        """Name chat `conv_id` `title` (its place in the list, by `updated`, stays); False, and
        nothing changed, once it is deleted (here, or by another process). One statement: two
        processes renaming a chat at once leave one name or the other, whole."""
        with self._locked(), self.db.conn:
            return self.db.execute(f"UPDATE {CONVERSATIONS} SET title = ? WHERE id = ?",
                                   [title, conv_id]).rowcount > 0

    def delete_conversation(self, conv_id: str) -> None:
        with self._locked(), self.db.conn:
            self.db.execute(f"DELETE FROM {MESSAGES} WHERE conversation_id = ?", [conv_id])
            self.db.execute(f"DELETE FROM {CONVERSATIONS} WHERE id = ?", [conv_id])

    # --- messages -----------------------------------------------------------------------
    def _message(self, row: dict) -> Message:
        return Message.of_row(row)

    def message(self, msg_id: str) -> Message:
        """The message `msg_id`; GoneError once it is deleted (`find` returns None instead)."""
        with self._locked():
            return self._message(self._row(MESSAGES, msg_id))

    def find(self, msg_id: str) -> Message | None:
        """The message, or None once it is deleted (here, or by another process)."""
        with self._locked():
            rows = list(self.db[MESSAGES].rows_where("id = ?", [msg_id]))
            return self._message(rows[0]) if rows else None

    def add(self, conv_id: str, parent_id: str | None, role: str, content: str,
            stats: dict | None = None, title: str | None = None) -> Message:
        """Append a message under `parent_id` (None: a root) and make it the current leaf. With
        `title`, a root message that is the chat's only one (its earlier ones were deleted)
        renames the chat."""
        row = {"id": _new_id(), "conversation_id": conv_id, "parent_id": parent_id, "role": role,
               "content": content, "created": time.time(), "active_child": None,
               "stats": json.dumps(stats) if stats else None}
        with self._locked(), self.db.conn:  # (one transaction: all of it, or nothing)
            self.db.execute("BEGIN IMMEDIATE")
            added = self.db.execute(
                f"""INSERT INTO {MESSAGES} ({', '.join(row)})
                    SELECT {', '.join(':' + k for k in row)}
                    WHERE EXISTS (SELECT 1 FROM {CONVERSATIONS} WHERE id = :conversation_id)
                      AND (:parent_id IS NULL OR EXISTS (SELECT 1 FROM {MESSAGES}
                           WHERE id = :parent_id AND conversation_id = :conversation_id))""",
                row,
            ).rowcount
            if not added:  # (deleted by another statechat process meanwhile)
                what = "the chat" if parent_id is None else "the message it answers or follows"
                raise GoneError(f"{what} was deleted (by another statechat process on this "
                                "cache dir); nothing was added")
            if title is not None and parent_id is None:
                self.db.execute(
                    f"""UPDATE {CONVERSATIONS} SET title = ? WHERE id = ? AND NOT EXISTS (
                          SELECT 1 FROM {MESSAGES} WHERE conversation_id = ? AND id != ?)""",
                    [title, conv_id, conv_id, row["id"]])
            self._point_path(conv_id, row["id"])
        return self._message(row)

    def update(self, msg_id: str, content: str | None = None, stats: dict | None = None,
               token_ids: list[int] | None = None) -> bool:
        """Replace a message's content and/or stats (a streamed reply being filled in); False
        (and nothing changed) once the message is deleted, here or by another process.
        `token_ids`: the ids the new content was made of, stored with it (a content given
        without them leaves the message none: the old ones would not be its ids)."""
        changes: dict = {}
        if content is not None:
            changes["content"] = content
            if "token_ids" in self.columns:  # (else none are kept: see ChatFile.columns)
                changes["token_ids"] = json.dumps(token_ids) if token_ids is not None else None
        if stats is not None:
            changes["stats"] = json.dumps(stats)
        sets = ", ".join(f"{k} = :{k}" for k in changes) or "id = id"
        with self._locked(), self.db.conn:
            sql = f"UPDATE {MESSAGES} SET {sets} WHERE id = :msg_id"
            return self.db.execute(sql, {**changes, "msg_id": msg_id}).rowcount > 0

    def token_ids(self, msg_id: str) -> list[int] | None:
        """The token ids message `msg_id`'s content was made of, as `update` stored them; None
        where none were (a user's message, a reply saved as it streamed, one made before they
        were kept, one deleted) or the column holds no list of ids (a row edited by hand)."""
        if "token_ids" not in self.columns:
            return None
        with self._locked():
            rows = list(self.db.execute(f"SELECT token_ids FROM {MESSAGES} WHERE id = ?",
                                        [msg_id]))
        try:
            ids = json.loads(rows[0][0]) if rows and rows[0][0] else None
        except (ValueError, RecursionError):
            return None
        # (an id is an int32: a larger one, edited by hand, made the tokenizer raise
        # OverflowError as `c` continued the reply, and the app end in its traceback)
        is_ids = isinstance(ids, list) and all(type(i) is int and 0 <= i < 2**31 for i in ids)
        return ids if is_ids else None

    def save_unfinished(self, msg_id: str, content: str) -> bool:
        """A streaming reply's text so far, with the UNFINISHED stats (a crash then keeps it),
        unless the reply was saved whole meanwhile (its own stats are never overwritten); no
        token ids (see `update`)."""
        unfinished = json.dumps(UNFINISHED)
        no_ids = ", token_ids = NULL" if "token_ids" in self.columns else ""
        with self._locked(), self.db.conn:
            return self.db.execute(
                f"UPDATE {MESSAGES} SET content = ?, stats = ?{no_ids} WHERE id = ? "
                "AND (stats IS NULL OR stats = ?)", [content, unfinished, msg_id, unfinished]
            ).rowcount > 0


def open_chats(cache_dir: Path, read_only: bool = False) -> ChatStore:
    """The conversation store of a cache dir (`<cache_dir>/index.db`); `read_only`: one that
    only reads an existing file (ChatFile)."""
    return ChatStore(Path(cache_dir) / "index.db", read_only=read_only)
