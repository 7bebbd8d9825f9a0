"""What the chats' store (tree.py) gives and raises: its records, Message and Conversation, and
its errors, GoneError, DamagedError and BusyError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from statechat.cache.sqlite_files import (
    SQLITE_BUSY,
    SQLITE_CANTOPEN,
    SQLITE_FULL,
    SQLITE_LOCKED,
    SQLITE_READONLY,
)
from statechat.errors import StatechatError

UNTITLED = "(untitled)"  # a chat whose row holds no title (edited by hand)
UNFINISHED = {"unfinished": True}  # the stats of a reply saved as it streams, until it ends


class GoneError(StatechatError):
    """What a change was for (a chat, a message) was deleted, by another statechat process."""


class DamagedError(StatechatError):
    """SQLite found the chats' file damaged (corrupt, not a database, an I/O error) as it read
    or wrote it."""


class BusyError(StatechatError):
    """SQLite could not use the chats' file for now (a full disk, another process holding it
    locked past the busy timeout, the file or its folder made read-only): nothing was changed,
    and the same change may work later. Its advice is BUSY_ADVICE's."""


# BusyError's advice, by SQLite's primary error code: the states of the file a user can end
BUSY_ADVICE = {
    SQLITE_FULL: "free some disk space and try again",
    SQLITE_BUSY: "another process holds the file locked: try again once it is done",
    SQLITE_LOCKED: "another process holds the file locked: try again once it is done",
    SQLITE_READONLY: "check that the file and its folder can be written, and try again",
    SQLITE_CANTOPEN: "check that the file and its folder can be written, and try again",
}


@dataclass(frozen=True)
class Message:
    id: str
    conversation_id: str
    parent_id: str | None
    role: str  # system | user | assistant
    content: str
    created: float
    stats: dict = field(default_factory=dict)

    def as_chat(self) -> dict:
        return {"role": self.role, "content": self.content}

    @classmethod
    def of_row(cls, row: dict) -> Message:
        """A chat_messages row as a Message. A row edited by hand or by another program reads
        as what it can be, and the chat stays usable: a content or role that is no text
        (NULL) as "" or "unknown", stats that are no JSON object as none (they are shown,
        never computed with)."""
        try:
            stats = json.loads(row["stats"]) if row.get("stats") else {}
        except (ValueError, RecursionError):
            stats = {}
        return cls(row["id"], row["conversation_id"], row["parent_id"],
                   _text(row["role"], "unknown"), _text(row["content"], ""),
                   row["created"], stats if isinstance(stats, dict) else {})


@dataclass(frozen=True)
class Conversation:
    id: str
    title: str
    created: float
    updated: float
    current_leaf: str | None

    @classmethod
    def of_row(cls, row: dict) -> Conversation:
        """A chat_conversations row as a Conversation; a title that is no text (NULL, a row
        edited by hand) reads as UNTITLED, as one chat's row must not keep the others from
        being listed."""
        return cls(row["id"], _text(row["title"], UNTITLED), row["created"], row["updated"],
                   row["current_leaf"])


def _text(value, default: str) -> str:
    """A column read as text: `default` for NULL, a number as its digits."""
    return default if value is None else str(value)
