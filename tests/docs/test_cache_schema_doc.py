"""docs/cache-schema.md names the tables, columns, types, views, indices and schema version that
statechat creates in `index.db`: a user who reads it can query the cache and the chats with
`sqlite3`. Fails when the code's schema and the page drift apart (no model is run)."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from statechat.cache.index import SCHEMA_VERSION, connect
from statechat.chat.storage import ChatFile

DOC = Path(__file__).resolve().parents[2] / "docs" / "cache-schema.md"
TYPES = {"integer": "INTEGER", "text": "TEXT", "real": "REAL"}


def documented_tables(text: str) -> dict[str, dict[str, str | None]]:
    """{table: {column: type or None}} from the page's tables: a heading or a line naming the
    table in backquotes, then `| column | type | meaning |` rows ("a, b" rows give both)."""
    tables: dict[str, dict[str, str | None]] = {}
    name = None
    for line in text.splitlines():
        named = re.match(r"^### `(\w+)`(?: — |$)|^`(\w+)` — ", line)
        if named:
            name = named.group(1) or named.group(2)
            tables[name] = {}
            continue
        row = re.match(r"^\| ([\w, ]+) \| *(\w*) *\|", line)
        if name and row and row.group(1) != "column":
            for column in row.group(1).split(","):
                tables[name][column.strip()] = TYPES[row.group(2)] if row.group(2) else None
        elif not line.startswith("|") and tables.get(name):
            name = None  # (the table ended)
    return tables


def documented_indices(text: str) -> set[str]:
    """`table.column` of every index the page's `Indices:` lines name."""
    found: set[str] = set()
    for line in re.findall(r"^Indices:.*(?:\n(?!\n).*)*", text, re.MULTILINE):
        found.update(re.findall(r"`(\w+\.\w+)`", line))
    return found


@pytest.fixture(scope="module")
def created(tmp_path_factory) -> sqlite3.Connection:
    """An index.db as the engine and the app make it: the cache's schema, the chats' tables,
    and chat_state (made when the app first shows a chat)."""
    path = tmp_path_factory.mktemp("cache") / "index.db"
    connect(path).conn.close()
    chats = ChatFile(path)
    chats.set_last_viewed("0123456789abcdef")
    chats.close()
    return sqlite3.connect(path)


def test_every_documented_table_and_column_is_created(created):
    text = DOC.read_text()
    tables = documented_tables(text)
    assert {"models", "checkpoints", "segments", "blocks", "disk_budget",
            "chat_conversations", "chat_messages"} <= set(tables)  # (the parser read the page)
    for table, columns in tables.items():
        made = {row[1]: row[2] for row in created.execute(f"PRAGMA table_info({table})")}
        assert set(columns) == set(made), f"docs/cache-schema.md: {table}"
        for column, kind in columns.items():
            assert kind in (None, made[column]), f"docs/cache-schema.md: {table}.{column}"


def test_every_created_table_and_view_is_documented(created):
    text = DOC.read_text()
    rows = created.execute("SELECT type, name FROM sqlite_master WHERE type IN ('table', 'view')"
                           " AND name NOT LIKE 'sqlite_%'").fetchall()
    for kind, name in rows:
        assert f"`{name}`" in text, f"{kind} {name} is not in docs/cache-schema.md"
    chat_state = {row[1] for row in created.execute("PRAGMA table_info(chat_state)")}
    assert chat_state == {"key", "value"} and "`key` text primary key, `value` text" in text


def test_documented_indices_and_version_match(created):
    text = DOC.read_text()
    made = set()
    for table, in created.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
        for index in created.execute(f"PRAGMA index_list({table})"):
            if index[3] == "c":  # (made by CREATE INDEX, not by a primary key)
                columns = created.execute(f"PRAGMA index_info({index[1]})").fetchall()
                made.add(f"{table}.{columns[0][2]}")
    assert documented_indices(text) == made
    assert f"`PRAGMA user_version`: {SCHEMA_VERSION}." in text
    assert created.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
