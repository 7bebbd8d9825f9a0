"""What the chats' store (tree.py) gives and raises: its records, Message and Conversation, and
its errors, GoneError, DamagedError and BusyError.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from statechat.errors import StatechatError

UNFINISHED = {"unfinished": True}  # the stats of a reply saved as it streams, until it ends


class GoneError(StatechatError):
    """What a change was for (a chat, a message) was deleted, by another statechat process."""


class DamagedError(StatechatError):
    """SQLite found the chats' file damaged (corrupt, not a database, an I/O error) as it read
    or wrote it."""


class BusyError(StatechatError):
    """SQLite could not use the chats' file for now (a full disk, another process holding it
    locked past the busy timeout): nothing was changed, and the same change may work later."""


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


@dataclass(frozen=True)
class Conversation:
    id: str
    title: str
    created: float
    updated: float
    current_leaf: str | None
