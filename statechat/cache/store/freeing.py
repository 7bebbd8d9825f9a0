"""Deleting a cache dir's blob files, and freeing its space where its index cannot be written.

On a full disk SQLite has no room for the index's journal, so no row can be deleted: `cache
clear` and `gc` then delete the blob files first, without the index's write lock, and their
rows once that room is made (cli_cache.py). A row naming a deleted file meanwhile is a miss
(reads.py), as after any lost blob; the chats, in the same index.db, are never touched.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from pathlib import Path

from statechat.cache.blobs.encoding import BLOB_NAME, TMP_SUFFIX, temp_writer

TMP_MIN_AGE_S = 60.0  # a temporary blob younger than this is a writer's, under way
TMP_MAX_AGE_S = 24 * 3600.0  # one older is a leftover, even where its writer's pid lives (reused)
# a process started this much after a temporary blob's mtime may still have written it (the boot
# time is in whole seconds, and some file systems keep mtimes to 1 or 2 s)
PID_START_SLACK_S = 2.0
# the rows an eviction deletes, first to last: least recently used first; ties from a chain's
# end back (a checkpoint's boundary, a segment's first block), a checkpoint before a segment
# (no NULLS FIRST: SQLite < 3.30). Rows: (kind, key, blob, bytes, last_used, position).
EVICTION_ORDER = (
    "SELECT 'ckpt', hash, blob, coalesce(bytes, 0), last_used, num_tokens / (SELECT block_size "
    "FROM models WHERE id = c.model_id) FROM checkpoints c UNION ALL SELECT 'kv', id, blob, "
    "coalesce(bytes, 0), "
    "last_used, coalesce((SELECT min(position) FROM blocks WHERE segment_id = s.id), 1 << 62) "
    "FROM segments s ORDER BY 5, 6 DESC, 1 LIMIT ?")


def is_pid_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this machine (one of another user's counts; pid 0, which
    os.kill takes for this process group, names no writer)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:  # (another user's)
        return True
    except (ProcessLookupError, OverflowError):  # (none, or a number no pid can be)
        return False
    return True


def pid_started_at(pid: int) -> float | None:
    """The unix time the process `pid` started (from Linux's /proc), None where it cannot be
    told (no /proc, the process gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # (starttime, ticks)
    except (OSError, IndexError, ValueError, StopIteration):
        return None


@functools.cache
def _boot_time() -> int:
    lines = Path("/proc/stat").read_text().splitlines()
    return next(int(line.split()[1]) for line in lines if line.startswith("btime "))


def is_writer(pid: int, mtime: float) -> bool:
    """Whether the process `pid` may be the one that last wrote a file at `mtime`: it runs,
    and it started before then (where that can be told). A pid is reused: a server restarted
    in a container after a kill -9 (an out-of-memory kill) has its predecessor's, often 1."""
    if not is_pid_alive(pid):
        return False
    started = pid_started_at(pid)
    return started is None or started <= mtime + PID_START_SLACK_S


def in_use(rel: str, mtime: float, now: float) -> bool:
    """Whether the temporary blob `rel` (its name under blobs/, last written at `mtime`) may be
    a save under way: younger than TMP_MIN_AGE_S, or its writer (the pid its name carries) still
    running, started before the file was last written (`is_writer`), and the file younger than
    TMP_MAX_AGE_S. A save waits any time for its row (a writer stalled, a slow disk): its temp
    is kept while its process lives."""
    if not rel.endswith(TMP_SUFFIX):
        return False
    age, pid = now - mtime, temp_writer(rel)
    return age < TMP_MIN_AGE_S or (pid is not None and age < TMP_MAX_AGE_S
                                   and is_writer(pid, mtime))


def delete_blob_files(blob_dir: Path) -> int:
    """Delete every file under `blob_dir` named as the store names its own (BLOB_NAME), but a
    temporary blob of a save under way (`in_use`), then the folders they leave empty; the
    bytes of the files deleted. Another process may delete them meanwhile."""
    freed, now = 0, time.time()
    for f in sorted(blob_dir.rglob("*"), reverse=True) if blob_dir.exists() else []:
        # the store's own files, then the folders they leave empty (another file stays)
        rel = f.relative_to(blob_dir).as_posix()
        if f.is_file() and BLOB_NAME.fullmatch(rel):
            with contextlib.suppress(FileNotFoundError):  # (another process removed it)
                st = f.stat()
                if in_use(rel, st.st_mtime, now):
                    continue
                f.unlink()
                freed += st.st_size
        elif f.is_dir() and not any(f.iterdir()):
            with contextlib.suppress(OSError):  # (a writer's new file just went in)
                f.rmdir()
    return freed


def delete_evicted_blobs(store, max_bytes: int) -> tuple[list[str], int]:
    """Delete the blob files of the rows that `store.evict_to(max_bytes)` would delete, their
    rows kept (`store`, a StateStore, may be opened read-only: a full disk's); their names and
    the bytes of the files deleted. `store.forget_blobs(names)` deletes the rows once the index
    can be written."""
    with store.db_lock:
        total = store.total_bytes()
        rows = store.db.execute(EVICTION_ORDER, [-1]).fetchall()
    names, freed = [], 0
    for _, _, blob, size, _, _ in rows:
        if total <= max_bytes:
            break
        total -= size
        names.append(blob)
        if BLOB_NAME.fullmatch(blob):  # (a row edited to name another file loses no file)
            with contextlib.suppress(FileNotFoundError):  # (another process removed it)
                st = (store.blob_dir / blob).stat()
                (store.blob_dir / blob).unlink()
                freed += st.st_size
    return names, freed
