"""The host and disk tiers of the state cache (StateStore), with write-behind persistence.

    store = open_store(cache_dir)                   # people's operations: stats, ls, verify, gc
    store.attach(fingerprint, name, ...)            # an engine's model: lookups and saves
    store.where(block_hashes, ckpt_hashes)          # which lower tier holds what (a Lookup)
    with store.reading():                           # held until host-tier reads are launched
        store.load_blocks(hashes)                   # verified tensors: host tier, or disk (on
        store.load_checkpoint(h)                    # the engine's device when it is CUDA)
    store.save(SaveJob)                             # queued; a thread writes blobs, then rows

    state_store.py  StateStore (its state, `attach`) and open_store
    reads.py        where, load_blocks, load_checkpoint; a blob failing verification is a miss
    lookup.py       Lookup: the tier of each block and checkpoint, and page-cache shares
    readahead.py    the index's read-ahead, through SQLite's own descriptors
    job.py          SaveJob: a checkpoint and its blocks, as the engine hands them over
    writer.py       the bounded queue and the writer thread: blobs, then their rows
    rows.py         a save's rows, in one transaction (none for a blob gone meanwhile)
    failures.py     FailedSaves: a warning line per cause of failed saves, then a count
    maintenance.py  the disk budget (LRU eviction) and stats, ls, verify, gc, clear
"""

from __future__ import annotations

from statechat.cache.store.job import SaveJob
from statechat.cache.store.lookup import Lookup
from statechat.cache.store.state_store import StateStore, open_store

__all__ = ["Lookup", "SaveJob", "StateStore", "open_store"]
