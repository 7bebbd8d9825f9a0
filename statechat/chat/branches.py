"""A conversation tree's branches: the path from a root to a message, a message's siblings and
children, which branch is shown (each message's `active_child`, the conversation's
`current_leaf`), and deleting a message with everything under it. ChatStore (tree.py) is built
on it and gives it `conversation`, `message`, `_message` and `_row`."""

from __future__ import annotations

import json
import time

from statechat.chat.records import Message
from statechat.chat.storage import CONVERSATIONS, MESSAGES, ChatFile


class ChatBranches(ChatFile):
    """The branch reads and moves of ChatStore (see the module docstring); thread-safe as it
    is, each under the file's lock."""

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

    def shape(self) -> dict[str, tuple[int, int]]:
        """Each chat's (messages, branches) by id: every message it holds, and its branches,
        the messages with no reply or follow-up under them (a chat with no message has none)."""
        with self._locked():
            rows = self.db.execute(
                f"""SELECT m.conversation_id, count(*), sum(NOT EXISTS (
                      SELECT 1 FROM {MESSAGES} k WHERE k.parent_id = m.id))
                    FROM {MESSAGES} m GROUP BY m.conversation_id""").fetchall()
        return {conv_id: (num, leaves) for conv_id, num, leaves in rows}

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
