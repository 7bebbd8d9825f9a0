"""A blob file the user may not delete (another user's, made by a `sudo` run in a shared cache
dir) is one line from `cache gc`, `clear` and `verify`, naming the file and what to check;
they ended in a PermissionError traceback. The rows go first all the same, so no row is left
naming a file that was deleted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from statechat import cli
from tests.cli.test_commands import warm_cache

pytest.importorskip("statechat.cache.store", reason="the persistent cache store is not in this "
                    "build")
OLD = 1_000_000_000  # a file time past the orphans' grace period


@pytest.mark.parametrize("argv", [["gc", "--max-bytes", "0"], ["clear", "--yes"], ["verify"]])
def test_a_blob_file_that_may_not_be_deleted_is_one_line(tmp_path, shared_engine, monkeypatch,
                                                         capsys, argv):
    cache = warm_cache(tmp_path)
    orphan = cache / "blobs" / "kv" / ("ab" * 16 + ".safetensors")  # (verify deletes it)
    orphan.write_bytes(b"x" * 10)
    os.utime(orphan, (OLD, OLD))

    def refused(self, *args, **kwargs):
        raise PermissionError(1, "Operation not permitted", str(self))

    monkeypatch.setattr(Path, "unlink", refused)
    monkeypatch.setattr("sys.argv", ["statechat", "cache", *argv, "--cache-dir", str(cache)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err, err
    assert err.startswith("statechat: cannot delete ") and str(cache / "blobs") in err, err
    assert "check the permissions" in err, err
