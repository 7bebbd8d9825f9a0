"""Reuses' marks for the store's writer: a prefix reused (or a checkpoint computed again that
the disk holds) marks its rows as used (`touch`), and a checkpoint read from disk counts a hit
(`count_hit`). Neither waits for the index: the marks and counts are kept apart, in memory,
and written by the writer thread (writer.py) in its next transaction, never in the request's
path, where another process's lock on the index would stall it."""

from __future__ import annotations

import time

from statechat.cache import index


class ReuseMarks:
    """The marks of StoreWriter (writer.py). Works on the store's `touched` ({chain hex: time}),
    `hit_counts` ({checkpoint hex: reads}), `pending_lock` and `db`."""

    def touch(self, chain: str) -> None:
        """Mark the checkpoint at the block hash `chain` and the segments of its chain as used
        (index.touch_chain), from the writer thread: a prefix reused from any tier, or a
        checkpoint computed again that the disk holds already, reads no row and saves none, yet
        it is in use. Never waits, and takes no room in the queue from saves: the mark is kept
        (the latest per `chain`) and written with the others in the writer's next transaction,
        within writer.TOUCH_WAIT_S when no save comes."""
        with self.pending_lock:
            self.touched[chain] = time.time()

    def count_hit(self, h: str) -> None:
        """Count a read of the checkpoint `h` from disk (its `hits`), written with the marks of
        reuses (`touch`): a read never waits for the index's write lock (another process's)."""
        with self.pending_lock:
            self.hit_counts[h] = self.hit_counts.get(h, 0) + 1

    def _take_touches(self) -> tuple[dict[str, float], dict[str, int]]:
        """The pending marks of reuses (kept pending until `_forget_touches`), and the counted
        disk reads of checkpoints (taken: lost with a transaction that fails)."""
        with self.pending_lock:
            hits, self.hit_counts = self.hit_counts, {}
            return dict(self.touched), hits

    def _mark_used(self, marks: dict[str, float], hits: dict[str, int]) -> None:
        """Mark each chain of `marks` as used at its time, and add `hits` to the checkpoints'
        counts, inside the caller's transaction."""
        for chain, when in marks.items():
            index.touch_chain(self.db, chain, when)
        self.db.conn.executemany("UPDATE checkpoints SET hits = hits + ? WHERE hash = ?",
                                 [(n, h) for h, n in hits.items()])

    def _forget_touches(self, marks: dict[str, float]) -> None:
        """Drop the marks written (or given up): those not touched again meanwhile."""
        with self.pending_lock:
            for chain, when in marks.items():
                if self.touched.get(chain) == when:
                    del self.touched[chain]
