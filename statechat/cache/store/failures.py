"""FailedSaves: how the store's writer tells of saves it could not make (a full disk, a lock
another process held past SQLite's wait): one warning line per cause, with what to do, and a
count of the failures after it rather than a line each (a batch on a full disk printed one
identical warning per checkpoint through its progress bar)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from statechat.cache.sqlite_files import is_full, is_locked, is_too_large

log = logging.getLogger("statechat.cache")
REPEAT_S = 600.0  # a cause's count of failures not shown is said at most this often (and at close)


class FailedSaves:
    """The failed saves of the store of the cache dir `path`, by cause (the error's first line).
    Any thread may call it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = 0  # every failed save
        self._lock = threading.Lock()
        self._causes: dict[str, tuple[float, int]] = {}  # cause -> (last said, failures unsaid)

    def failed(self, error: Exception) -> None:
        """Count a failed save; the first of its cause is one warning line (the error's first
        line), those after it are counted, and the count said every REPEAT_S (and by
        `close`)."""
        cause = _cause(error)
        now = time.monotonic()
        with self._lock:
            self.count += 1
            said, unsaid = self._causes.get(cause, (None, 0))
            if said is not None and now - said < REPEAT_S:
                self._causes[cause] = (said, unsaid + 1)
                return
            self._causes[cause] = (now, 0)
        if said is None:
            first = (str(error).splitlines() or [type(error).__name__])[0]
            log.warning("statechat cache: could not persist a checkpoint (%s)%s (further "
                        "failures like it are counted, not shown)", first, self._advice(error))
        else:
            self._say(cause, unsaid + 1)

    def close(self) -> None:
        """Say the count of each cause's failures not shown yet."""
        with self._lock:
            counts = [(cause, unsaid) for cause, (_, unsaid) in self._causes.items() if unsaid]
            self._causes = {cause: (said, 0) for cause, (said, _) in self._causes.items()}
        for cause, unsaid in counts:
            self._say(cause, unsaid)

    def _say(self, cause: str, unsaid: int) -> None:
        log.warning("statechat cache: %d more checkpoint%s could not be persisted (%s)", unsaid,
                    "s" if unsaid != 1 else "", cause)

    def _advice(self, error: Exception) -> str:
        """What to do about `error`, after a semicolon; empty where the error says it."""
        if is_full(error):
            return f"; free some space on the disk of {self.path}, or pick another cache dir"
        if is_too_large(error):
            return ("; a blob is larger than a file may be there (the file size limit, `ulimit "
                    "-f`, or the file system's largest file): raise the limit, or pick a cache "
                    "dir on another file system")
        if is_locked(error):  # (transient: the next save tries again)
            return (f"; another process held {self.path / 'index.db'} locked past SQLite's "
                    "wait (a `sqlite3` shell inside a transaction, say): the saves after it "
                    "go on once it is done")
        return ""


def _cause(error: Exception) -> str:
    """What failed saves of one cause share: the error's first line, less the file an OSError
    names (each save fails at a file of its own, a read-only folder's say: `[Errno 30]
    Read-only file system: '.../kv/<name>.tmp'`)."""
    if isinstance(error, OSError) and error.errno is not None and error.strerror:
        return f"[Errno {error.errno}] {error.strerror}"
    return (str(error).splitlines() or [type(error).__name__])[0]
