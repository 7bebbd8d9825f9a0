"""Conversation trees in SQLite: every message keeps its parent, so nothing an edit replaces is
lost.

A conversation is a tree of messages; the branch on screen is the path from a root to the
conversation's `current_leaf`. Editing a message adds a sibling (a new branch from its parent),
regenerating a reply adds a sibling reply, and so does continuing one (the reply's text and the
token ids it was made of, kept with it, are where a continuation begins); switching siblings
follows each message's `active_child` down to a leaf, so a branch comes back as it was left.

The tables, in `<cache_dir>/index.db`, and how the file opens are storage.py's; the records
and errors it gives are records.py's.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from statechat.chat.records import (
    UNFINISHED,
    BusyError,
    Conversation,
    DamagedError,
    GoneError,
    Message,
)
from statechat.chat.storage import CONVERSATIONS, MESSAGES, ChatFile

GONE = "{what} {id} is gone (deleted, here or by another statechat process on this cache dir)"

# (the store's callers import its records and errors from here, as before storage.py)
__all__ = ["UNFINISHED", "BusyError", "ChatStore", "Conversation", "DamagedError", "GoneError",
           "Message", "open_chats"]


def _new_id() -> str:
    return uuid.uuid4().hex[:16]


class ChatStore(ChatFile):
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

    def branch(self, conv_id: str) -> list[Message]:
        """The messages from the root to the current leaf, in order. A leaf whose row is gone,
        or none, in a chat with messages (rows edited by hand) reads as its newest message (the
        chat read as empty, its messages hidden)."""
        with self._locked():
            leaf = self.conversation(conv_id).current_leaf
            path = self.path(leaf) if leaf else []
            if path:
                return path
            newest = self.db.execute(f"SELECT id FROM {MESSAGES} WHERE conversation_id = ? "
                                     "ORDER BY created DESC, rowid DESC LIMIT 1",
                                     [conv_id]).fetchone()
            return self.path(newest[0]) if newest else []

    def path(self, msg_id: str) -> list[Message]:
        """The messages from the root down to `msg_id` (included), in order. Parents that
        loop (rows edited by hand) end the path where one comes round again (it hung)."""
        with self._locked():
            rows = self.db.execute(
                f"""WITH RECURSIVE up(id, depth, seen) AS (
                      SELECT ?1, 0, ',' || ?1 UNION ALL
                      SELECT m.parent_id, up.depth + 1, up.seen || ',' || m.parent_id
                      FROM {MESSAGES} m JOIN up ON m.id = up.id
                      WHERE m.parent_id IS NOT NULL
                        AND instr(up.seen || ',', ',' || m.parent_id || ',') = 0)
                    SELECT m.* FROM up JOIN {MESSAGES} m ON m.id = up.id ORDER BY up.depth DESC""",
                [msg_id],
            )
            cols = [d[0] for d in rows.description]
            return [self._message(dict(zip(cols, r))) for r in rows.fetchall()]

    def siblings(self, msg_id: str) -> list[Message]:
        """The message and its siblings (same parent), oldest first."""
        with self._locked():
            msg = self.message(msg_id)
            if msg.parent_id is None:
                where, args = "conversation_id = ? AND parent_id IS NULL", [msg.conversation_id]
            else:
                where, args = "parent_id = ?", [msg.parent_id]
            rows = self.db[MESSAGES].rows_where(where, args, order_by="created, rowid")
            return [self._message(r) for r in rows]

    def places(self, msgs: list[Message]) -> list[tuple[int, int]]:
        """Each message's place among its siblings as `siblings` orders them, (its position
        from 1, their number), read in one query (`siblings` for each message of a 300-message
        branch took 0.15 s); (1, 1) for a message deleted meanwhile."""
        with self._locked():
            rows = self.db.execute(
                f"""SELECT id, parent_id, conversation_id FROM {MESSAGES}
                    WHERE parent_id IN (SELECT value FROM json_each(?1))
                       OR (parent_id IS NULL AND conversation_id IN
                           (SELECT value FROM json_each(?2)))
                    ORDER BY created, rowid""",
                [json.dumps([m.parent_id for m in msgs if m.parent_id is not None]),
                 json.dumps([m.conversation_id for m in msgs if m.parent_id is None])],
            ).fetchall()
        groups: dict[tuple[str | None, str | None], list[str]] = {}  # (a root's siblings:
        for msg_id, parent_id, conv_id in rows:  # its chat's roots)
            groups.setdefault((parent_id, None if parent_id else conv_id), []).append(msg_id)
        places = []
        for m in msgs:
            sibs = groups.get((m.parent_id, None if m.parent_id else m.conversation_id), [])
            places.append((sibs.index(m.id) + 1, len(sibs)) if m.id in sibs else (1, 1))
        return places

    def children(self, msg_id: str) -> list[Message]:
        with self._locked():
            rows = self.db[MESSAGES].rows_where("parent_id = ?", [msg_id],
                                                order_by="created, rowid")
            return [self._message(r) for r in rows]

    def select(self, msg_id: str) -> str:
        """Show the branch through `msg_id`: follow active children down; return the new leaf."""
        with self._locked():
            leaf, seen = msg_id, {msg_id}
            while True:
                row = self._row(MESSAGES, leaf)
                ids = [k.id for k in self.children(leaf) if k.id not in seen]  # (a loop of
                if not ids:  # parents, edited by hand, came round again: it ends there)
                    break
                leaf = row["active_child"] if row["active_child"] in ids else ids[-1]
                seen.add(leaf)
            self._set_leaf(self.message(msg_id).conversation_id, leaf)
            return leaf

    def switch(self, msg_id: str, offset: int) -> Message:
        """Move to the sibling `offset` places away (clamped) and show its branch."""
        sibs = self.siblings(msg_id)
        i = next(i for i, m in enumerate(sibs) if m.id == msg_id)
        target = sibs[max(0, min(len(sibs) - 1, i + offset))]
        self.select(target.id)
        return target

    def num_under(self, msg_id: str) -> int:
        """How many messages lie under `msg_id`, on every branch (what `delete_branch` would
        delete with it)."""
        with self._locked():
            rows = self.db.execute(
                f"""WITH RECURSIVE sub(id) AS (
                      SELECT id FROM {MESSAGES} WHERE parent_id = ?1 UNION
                      SELECT m.id FROM {MESSAGES} m JOIN sub ON m.parent_id = sub.id)
                    SELECT count(*) FROM sub WHERE id != ?1""", [msg_id])
            return rows.fetchone()[0]

    def delete_branch(self, msg_id: str) -> None:
        """Delete a message and everything under it; show a sibling's branch, else the parent's."""
        with self._locked():
            msg = self.message(msg_id)
            others = [m for m in self.siblings(msg_id) if m.id != msg_id]
            with self.db.conn:
                self.db.execute(
                    f"""WITH RECURSIVE sub(id) AS (
                          SELECT ? UNION
                          SELECT m.id FROM {MESSAGES} m JOIN sub ON m.parent_id = sub.id)
                        DELETE FROM {MESSAGES} WHERE id IN (SELECT id FROM sub)""",
                    [msg_id],
                )
            if others:
                self.select(others[-1].id)
            else:
                self._set_leaf(msg.conversation_id, msg.parent_id)

    def _set_leaf(self, conv_id: str, leaf: str | None) -> None:
        """Make `leaf` current and point every ancestor's active_child along its path, in one
        transaction (one statement for the path: a long chat's path is hundreds of messages)."""
        with self.db.conn:
            self._point_path(conv_id, leaf)

    def _point_path(self, conv_id: str, leaf: str | None) -> None:
        """_set_leaf's writes, in the caller's transaction."""
        if leaf is not None:
            self.db.execute(
                f"""WITH RECURSIVE up(id, child) AS (
                      SELECT parent_id, id FROM {MESSAGES} WHERE id = :leaf
                      UNION
                      SELECT m.parent_id, m.id FROM {MESSAGES} m JOIN up ON m.id = up.id)
                    UPDATE {MESSAGES}
                    SET active_child = (SELECT child FROM up WHERE up.id = {MESSAGES}.id)
                    WHERE id IN (SELECT id FROM up WHERE id IS NOT NULL)""",
                {"leaf": leaf},
            )
        self.db.execute(
            f"UPDATE {CONVERSATIONS} SET current_leaf = ?, updated = ? WHERE id = ?",
            [leaf, time.time(), conv_id],
        )


def open_chats(cache_dir: Path) -> ChatStore:
    """The conversation store of a cache dir (`<cache_dir>/index.db`)."""
    return ChatStore(Path(cache_dir) / "index.db")
