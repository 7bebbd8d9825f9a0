"""The chats' SQLite file (ChatFile): its tables, how it opens, and how its errors read.

Tables (in `<cache_dir>/index.db`, WAL, beside the cache's own tables; all prefixed `chat_`):
  chat_conversations(id, title, created, updated, current_leaf)
  chat_messages(id, conversation_id, parent_id, role, content, created, active_child, stats,
                token_ids)
`stats` is JSON: the reply's ttft_s, tokens/s and cache reuse, shown again after a restart
(and `thinking` where its prompt opened its reasoning: tui/format.py).
`token_ids` is a JSON array, or NULL: the token ids a reply's content was made of, its stop
token left out (a continuation feeds them back as they were made: chat/continuing.py).
  chat_state(key, value)
holds the app's state between runs: `last_viewed`, the id of the chat it showed last (made at
the first write: a file of an earlier statechat, or one that cannot be written, has none).
ChatStore (tree.py) keeps the conversation trees in them.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from pathlib import Path

import sqlite_utils

from statechat.cache.index import refuse_foreign
from statechat.cache.sqlite_files import (
    is_locked,
    is_unusable,
    lenient_text,
    open_sqlite,
    primary_code,
)
from statechat.chat.records import BUSY_ADVICE, BusyError, DamagedError

CONVERSATIONS, MESSAGES, STATE = "chat_conversations", "chat_messages", "chat_state"
# chat_messages' columns that came after its first version: a file made before them gets them
# as it opens (their rows NULL; an earlier statechat on the same file leaves them NULL too)
NEWER_COLUMNS = {"token_ids": str}
BUSY_TIMEOUT_S = 30  # how long a use of the file waits for another process's lock
ADD_COLUMN_WAIT_S = 1.0  # how long an open waits for it to add NEWER_COLUMNS (else: later)
STATE_WAIT_S = 1.0  # how long `set_last_viewed` waits for another process's lock (else: not saved)


class ChatFile:
    """The chats' tables in one SQLite file, opened (and created) at `path`; its users hold
    `_locked()` around each use, which also turns SQLite's errors into the user's words.
    `columns`: chat_messages' columns; a file from an earlier statechat lacks NEWER_COLUMNS
    while it cannot be written (another process holds it locked, read-only media, a full
    disk): it opens without them, as that statechat opened it, and a later open adds them.
    With `read_only`, an existing file is only read (`statechat chats ls`, on read-only media
    too): nothing is created, and a file without the chats' tables reads as holding none."""

    def __init__(self, path: Path, read_only: bool = False) -> None:
        self.file = Path(path)
        self._lock = threading.RLock()
        self.columns: set[str] = set()
        self.db = open_sqlite(self.file, self._open_read_only if read_only else self._open)

    def _open_read_only(self) -> sqlite_utils.Database:
        from statechat.cache.index_read import query_only

        conn, _ = query_only(self.file, BUSY_TIMEOUT_S)
        try:
            refuse_foreign(conn, self.file)
        except BaseException:
            conn.close()
            raise
        self.db = sqlite_utils.Database(conn)
        self.columns = set(self.db[MESSAGES].columns_dict)
        return self.db

    @property
    def has_chats(self) -> bool:
        """Whether the file holds the chats' tables (a cache index alone does not)."""
        with self._locked():
            return self.db[CONVERSATIONS].exists()

    def _open(self) -> sqlite_utils.Database:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite_utils.Database(sqlite3.connect(str(self.file), check_same_thread=False,
                                                        timeout=BUSY_TIMEOUT_S))
        self.db.conn.text_factory = lenient_text
        try:
            refuse_foreign(self.db.conn, self.file)  # (another program's file: left alone)
            self.db.enable_wal()
            self._create_tables()
        except BaseException:
            self.db.conn.close()
            raise
        return self.db

    def _create_tables(self) -> None:
        with self._lock:
            self.db[CONVERSATIONS].create(
                {"id": str, "title": str, "created": float, "updated": float, "current_leaf": str},
                pk="id", if_not_exists=True,
            )
            self.db[MESSAGES].create(
                {"id": str, "conversation_id": str, "parent_id": str, "role": str, "content": str,
                 "created": float, "active_child": str, "stats": str, **NEWER_COLUMNS},
                pk="id", if_not_exists=True,
                foreign_keys=[("conversation_id", CONVERSATIONS, "id")],
            )
            self.db[MESSAGES].create_index(["conversation_id"], if_not_exists=True)
            self.db[MESSAGES].create_index(["parent_id"], if_not_exists=True)
            self._add_newer_columns()

    def _add_newer_columns(self) -> None:
        """NEWER_COLUMNS that a file made by an earlier statechat lacks, added, waiting at most
        ADD_COLUMN_WAIT_S for another process's lock; left out while the file cannot be written
        (see `columns`). Another process may add one at the same moment: the 'duplicate
        column' it leaves this one is as good."""
        table = self.db[MESSAGES]
        for name, kind in NEWER_COLUMNS.items():
            if name in table.columns_dict:
                continue
            self.db.execute(f"PRAGMA busy_timeout = {int(ADD_COLUMN_WAIT_S * 1000)}")
            try:
                table.add_column(name, kind)
            except sqlite3.OperationalError as e:
                if name not in table.columns_dict and not _for_now(e):
                    raise
            finally:
                self.db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_S * 1000}")
        self.columns = set(table.columns_dict)

    def last_viewed(self) -> str | None:
        """The id of the chat `set_last_viewed` saved last (it may since be deleted); None if
        none was."""
        with self._locked():
            if not self.db[STATE].exists():
                return None
            row = self.db.execute(f"SELECT value FROM {STATE} WHERE key = 'last_viewed'")
            value = (row.fetchone() or [None])[0]
        return value if isinstance(value, str) else None

    def set_last_viewed(self, conv_id: str) -> None:
        """Save `conv_id` as the chat viewed last (chat_state is made here, once). It is no
        chat's content: where another process holds the file locked, BusyError after
        STATE_WAIT_S, not BUSY_TIMEOUT_S (a chat opened, or the app started, would hang)."""
        with self._locked():
            self.db.execute(f"PRAGMA busy_timeout = {int(STATE_WAIT_S * 1000)}")
            try:
                with self.db.conn:
                    self.db.execute(f"CREATE TABLE IF NOT EXISTS {STATE} "
                                    "(key TEXT PRIMARY KEY, value TEXT)")
                    self.db.execute(f"INSERT INTO {STATE} (key, value) VALUES ('last_viewed', ?) "
                                    "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                                    [conv_id])
            finally:
                self.db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_S * 1000}")

    def close(self) -> None:
        self.db.conn.close()

    @contextlib.contextmanager
    def _locked(self):
        """The lock, around a use of the file; DamagedError if SQLite finds it damaged,
        BusyError if it cannot use it for now (a full disk, a lock held past the busy timeout,
        the file made read-only: the app crashed on them)."""
        with self._lock:
            try:
                yield
            except sqlite3.DatabaseError as e:
                why = (str(e).splitlines() or [type(e).__name__])[0]
                fix = BUSY_ADVICE.get(primary_code(e))
                if isinstance(e, sqlite3.OperationalError) and fix:
                    raise BusyError(f"the chats in {self.file} could not be saved ({why}); "
                                    f"{fix}") from None
                if not is_unusable(e):
                    raise
                raise DamagedError(
                    f"the chats in {self.file} are damaged ({why}); `sqlite3 {self.file} "
                    f".recover | sqlite3 {self.file}.recovered` copies what is left of them into "
                    "a file to put in its place, or move the file away to start afresh") from None


def _for_now(error: sqlite3.OperationalError) -> bool:
    """Whether `error` is a state of the file that may end (BusyError's causes: a lock,
    read-only media, a full disk), rather than of its contents."""
    return (is_locked(error) or primary_code(error) in BUSY_ADVICE
            or any(word in str(error) for word in ("readonly", "disk is full")))
