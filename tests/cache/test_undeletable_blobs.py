"""A blob file the process may not delete (another user's, in a cache dir shared with a run
under sudo) costs a warning, never a request: a damaged one is a miss with the no-cache tokens
(the engine crashed with a PermissionError), and an eviction goes on past it, counting as freed
only the bytes it deleted (`cache gc` said it freed the files it left)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from statechat.cache.store import open_store
from tests.cache.test_corruption import PARAMS, ckpt_blob, engine, model, warm_cache  # noqa: F401


@pytest.fixture
def refused(monkeypatch):
    """Path.unlink refusing every blob file (as for another user's), other files deleted."""
    unlink = Path.unlink

    def refusing(self, *args, **kwargs):
        if "blobs" in self.parts:
            raise PermissionError(1, "Operation not permitted", str(self))
        return unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", refusing)


def test_a_damaged_blob_that_may_not_be_deleted_is_a_miss(model, warm_cache, refused,  # noqa: F811
                                                          caplog):
    path, loaded, prompt, expected = model
    blob = ckpt_blob(warm_cache, 192)
    data = bytearray(blob.read_bytes())
    data[-5] ^= 0xFF
    blob.write_bytes(data)
    second = engine(path, loaded, warm_cache)
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        out = second.generate([prompt], PARAMS)[0]
    second.close()
    assert out.token_ids == expected
    said = [r.getMessage() for r in caplog.records if "could not delete" in r.getMessage()]
    assert len(said) == 1 and "check the permissions" in said[0], caplog.text


def test_an_eviction_goes_past_a_blob_that_may_not_be_deleted(warm_cache, refused,  # noqa: F811
                                                              caplog):
    store = open_store(warm_cache)
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        freed = store.evict_to(0)
    assert freed == 0 and store.stats()["num_checkpoints"] == 0
    store.close()
    assert sum("could not delete" in r.getMessage() for r in caplog.records) == 1
