"""Long mixed use of an engine with a disk tier leaks nothing: after each phase of the engine
tests' fuzz (tests/engine/test_leaks.py; the device tier dropped between phases, so requests
resume from the host tier and disk too, and a small disk budget evicts), the write queue
drains, no temporary or orphan blob is left, the blobs keep to the budget, the index names no
damaged blob, the pools are whole, what the engine remembers of the disk stays bounded (it
kept every block hash it ever saved: 557 for 40 on disk after 400 requests), and open file
descriptors and threads do not grow; closing the engine gives its descriptors back."""

from __future__ import annotations

import os
import random
import threading

import pytest

from statechat.cache.blobs.encoding import TMP_SUFFIX
from tests.engine.test_leaks import fuzz, loaded, small_engine  # noqa: F401 (a fixture)
from tests.helpers import assert_idle_pools

BUDGET = 3 << 20  # some 40 blocks of the tiny model's KV, and checkpoints


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def assert_drained(store) -> None:
    """The store's writes all done, and its folder holding only what its index names."""
    store.flush()
    assert store.queue.unfinished_tasks == 0 and store.pending_bytes == 0
    assert not list(store.path.rglob(f"*{TMP_SUFFIX}")), "temporary blobs left"
    assert store._remove_orphans(min_age_s=0, remove=False) == [], "orphan blobs left"
    blobs = sum(f.stat().st_size for f in store.blob_dir.rglob("*") if f.is_file())
    assert blobs == store.total_bytes() <= BUDGET


def assert_bounded_memory(engine) -> None:
    """What the engine remembers of the disk (the blocks and checkpoints it saved or found
    there) is bounded by what the budget can hold (twice over), not by all it ever saved."""
    prefix = engine.prefix
    blocks, ckpts = len(prefix.persisted), len(prefix.stored_ckpts)
    assert blocks <= 2 * BUDGET // prefix.bytes_per_block, blocks
    assert ckpts <= 2 * BUDGET // prefix.bytes_per_slot, ckpts


def test_a_long_fuzz_on_a_disk_tier_leaks_nothing(loaded, tmp_path):  # noqa: F811
    fds, threads = open_fds(), set(threading.enumerate())
    engine = small_engine(loaded, cache_dir=tmp_path, disk_cache_bytes=BUDGET)
    store, rng, seen = engine.store, random.Random(5), []
    for _ in range(3):
        fuzz(engine, rng, 40, [])
        assert_drained(store)
        assert_idle_pools(engine)
        assert_bounded_memory(engine)
        seen.append((open_fds(), threading.active_count()))
        engine.drop_device_cache()
    report = store.verify(remove=False)
    assert report["checked"] > 0 and report["checked"] == report["ok"], report
    assert seen[2] <= seen[1], seen  # (the first phase opens what the others reuse)
    engine.close()
    assert store.writer is None
    assert open_fds() == fds
    left = [t.name for t in set(threading.enumerate()) - threads]
    # (but the blob readers' pools, a few threads for the life of the process)
    assert all(n.startswith(("statechat-blob_", "statechat-segment_")) for n in left), left


def test_a_restore_that_fails_unexpectedly_leaks_nothing(loaded, tmp_path):  # noqa: F811
    """A restore from the lower tiers that raises an error neither of an index nor of a blob (a
    device copy failing, say) fails its step; the request, aborted as the server's worker does,
    leaves no block or slot behind, and the same prompt is then served from the cache."""
    from statechat.engine.sampling import SamplingParams
    from tests.helpers import random_prompts

    engine = small_engine(loaded, cache_dir=tmp_path, disk_cache_bytes=BUDGET)
    prompt, params = random_prompts(300)[0], SamplingParams(max_tokens=3, ignore_eos=True)
    first = engine.generate([prompt], params)[0]
    engine.store.flush()
    engine.drop_device_cache()
    write_blocks = engine.runner.write_blocks

    def failing(*_args):
        raise RuntimeError("a device copy failed")

    engine.runner.write_blocks = failing
    seq = engine.add_request(prompt, params)
    with pytest.raises(RuntimeError, match="device copy"):
        engine.step()
    engine.abort(seq)
    assert_idle_pools(engine)
    engine.runner.write_blocks = write_blocks
    again = engine.generate([prompt], params)[0]
    assert again.token_ids == first.token_ids and again.num_cached_tokens > 0
    engine.close()
