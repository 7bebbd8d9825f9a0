"""`statechat chats` on a chat whose text is not UTF-8 (a title or message edited by hand with
`sqlite3`, which stores whatever bytes it is given): each command still lists, shows, exports
and deletes it, the bad bytes shown as U+FFFD, instead of a traceback."""

from __future__ import annotations

import json
import sqlite3

from statechat.chat.tree import open_chats
from tests.cli.test_chats import chats


def seed_bad_bytes(cache_dir) -> str:
    """One chat, its title and its message holding bytes that are not UTF-8; its id."""
    store = open_chats(cache_dir)
    conv = store.create("Fine")
    store.add(conv.id, None, "user", "fine too")
    store.close()
    with sqlite3.connect(cache_dir / "index.db") as db:  # (as `sqlite3 index.db` would)
        db.execute("UPDATE chat_conversations SET title = CAST(X'54FE6974' AS TEXT)")
        db.execute("UPDATE chat_messages SET content = CAST(X'68FF69' AS TEXT)")
    db.close()
    return conv.id


def test_a_chat_with_bytes_that_are_not_utf8_is_read_with_replacements(tmp_path):
    conv_id = seed_bad_bytes(tmp_path / "cache")
    listed = chats(tmp_path, "ls", "--json")
    assert listed.exit_code == 0, listed.stderr
    assert json.loads(listed.stdout)[0]["title"] == "T\ufffdit"
    assert chats(tmp_path, "ls").stdout.count(conv_id) == 1
    shown = chats(tmp_path, "show", conv_id, "--json")
    assert shown.exit_code == 0, shown.stderr
    assert json.loads(shown.stdout) == [{"role": "user", "content": "h\ufffdi"}]
    exported = chats(tmp_path, "export", conv_id)
    assert exported.exit_code == 0 and "h\ufffdi" in exported.stdout, exported.stderr
    gone = chats(tmp_path, "rm", conv_id, "--yes")
    assert gone.exit_code == 0, gone.stderr
    assert json.loads(chats(tmp_path, "ls", "--json").stdout) == []
