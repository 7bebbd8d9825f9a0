"""A `cache clear` stopped part way (Ctrl+C, a file it cannot delete) leaves no index row
naming a blob file it already deleted: the rows go first, as every deletion's do. It rolled
the rows back after deleting files, so `stats` went on counting the deleted blobs and the next
run warned of each one missing."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.cli.test_commands import warm_cache

pytest.importorskip("statechat.cache.store", reason="the persistent cache store is not in this "
                    "build")


def rows_without_files(cache) -> list[str]:
    """The blobs the index names whose files are gone."""
    db = sqlite3.connect(cache / "index.db")
    names = [r[0] for r in db.execute("SELECT blob FROM checkpoints UNION SELECT blob FROM "
                                      "segments")]
    db.close()
    return [n for n in names if not (cache / "blobs" / n).exists()]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, PermissionError])
def test_a_clear_stopped_part_way_leaves_no_row_naming_a_deleted_blob(tmp_path, shared_engine,
                                                                     monkeypatch, stop):
    from statechat.cache.store import open_store

    cache = warm_cache(tmp_path)
    unlink, calls = Path.unlink, []

    def stopping_unlink(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 2:  # (one blob file deleted, then the stop)
            raise stop()
        return unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", stopping_unlink)
    store = open_store(cache)
    with pytest.raises(stop):
        store.clear()
    store.close()
    monkeypatch.setattr(Path, "unlink", unlink)
    assert rows_without_files(cache) == []
    store = open_store(cache)
    assert store.stats()["num_checkpoints"] == 0
    assert store.clear() > 0  # (what was left: orphan files, deleted by the next clear)
    store.close()
    assert list((cache / "blobs").rglob("*.safetensors")) == []
