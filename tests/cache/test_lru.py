"""The disk budget's LRU sees a prefix reused from memory: each save marks the segments of the
chain it stands on as used, and so does each reuse (from any tier) and each checkpoint computed
again, for the checkpoint too. A conversation's first blocks (a shared system prompt's) are
read back from device memory on every turn, never from disk, so their rows kept the oldest
`last_used` and were the first a full disk evicted, under the chats still growing on them."""

from __future__ import annotations

import sqlite3
import time

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def oldest_segment_first_block(cache_dir) -> tuple[str, ...]:
    """The first block hash of each segment, least recently used first."""
    db = sqlite3.connect(cache_dir / "index.db")
    rows = db.execute("SELECT (SELECT hash FROM blocks WHERE segment_id = s.id ORDER BY position "
                      "LIMIT 1) FROM segments s ORDER BY s.last_used, s.id").fetchall()
    db.close()
    return tuple(r[0] for r in rows)


def test_a_conversation_s_first_blocks_stay_recent_while_it_grows(tiny_dirs, tmp_path):
    path = tiny_dirs["qwen3_5_text"]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path),
                       loaded=load_model(path, dtype=torch.float32))
    gen = torch.Generator().manual_seed(8)
    chat = torch.randint(0, 300, (200,), generator=gen).tolist()
    other = torch.randint(0, 300, (200,), generator=gen).tolist()
    engine.generate([chat], PARAMS)
    engine.store.flush()
    first = oldest_segment_first_block(tmp_path)[0]  # (the chat's first block)
    time.sleep(0.05)
    engine.generate([other], PARAMS)  # another chat, saved after the first one
    engine.store.flush()
    time.sleep(0.05)
    grown = chat + torch.randint(0, 300, (150,), generator=gen).tolist()
    out = engine.generate([grown], PARAMS)[0]  # the first chat's next turn, from memory
    engine.store.flush()
    assert out.reused_from == "device"
    order = oldest_segment_first_block(tmp_path)
    engine.close()
    assert order[0] != first and first in order  # the other chat's is the LRU victim now


def rows(cache_dir) -> set[tuple[str, str]]:
    """Every checkpoint and segment row, as the budget's eviction names them."""
    db = sqlite3.connect(cache_dir / "index.db")
    found = db.execute("SELECT 'ckpt', hash FROM checkpoints UNION ALL "
                       "SELECT 'kv', CAST(id AS TEXT) FROM segments").fetchall()
    db.close()
    return set(found)


def two_chats(engine, cache_dir, seed: int) -> tuple[list[int], set, set]:
    """Run a chat, then another one a moment later, each saved: (the first chat's prompt, its
    rows, the other's rows)."""
    gen = torch.Generator().manual_seed(seed)
    chat, other = (torch.randint(0, 300, (200,), generator=gen).tolist() for _ in range(2))
    engine.generate([chat], PARAMS)
    engine.store.flush()
    chat_rows = rows(cache_dir)
    time.sleep(0.05)
    engine.generate([other], PARAMS)  # (its checkpoint may take the chat's place in memory)
    engine.store.flush()
    other_rows = rows(cache_dir) - chat_rows
    time.sleep(0.05)
    return chat, chat_rows, other_rows


@pytest.mark.parametrize("tier", ["device", "host"])
def test_a_prefix_reused_without_a_save_outlives_one_not_used_since(tiny_dirs, tmp_path, tier):
    """A regenerate served from device memory (or, once device memory was dropped, from the
    host tier) saves nothing new: its checkpoint and the segments under it are marked used
    all the same, so the budget evicts the other chat's rows, not this one's. (They kept the
    `last_used` of their first save, and the chat in use was the first victim: its
    checkpoint, which no save ever touched again, or a segment under it.)"""
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path), loaded=loaded)
    chat, chat_rows, other_rows = two_chats(engine, tmp_path, 9)
    if tier == "host":
        engine.drop_device_cache()
    again = engine.generate([chat], PARAMS)[0]  # a regenerate: every checkpoint already stored
    engine.store.flush()
    assert again.reused_from == tier and again.num_cached_tokens == 192
    assert rows(tmp_path) == chat_rows | other_rows  # (nothing new saved)
    store = engine.store
    with store.db_lock:
        other_bytes = store.db.execute(
            "SELECT (SELECT sum(bytes) FROM checkpoints WHERE hash IN ({0})) + (SELECT sum(bytes) "
            "FROM segments WHERE CAST(id AS TEXT) IN ({0}))".format(
                ",".join(f"'{key}'" for _, key in other_rows))).fetchone()[0]
    store.evict_to(store.total_bytes() - other_bytes)
    assert rows(tmp_path) == chat_rows  # the LRU victims: the other chat's rows, all of them
    engine.close()
    fresh = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path), loaded=loaded)
    out = fresh.generate([chat], PARAMS)[0]
    fresh.close()
    assert out.reused_from == "disk" and out.num_cached_tokens == 192


def test_a_stored_checkpoint_computed_again_counts_as_used(tiny_dirs, tmp_path):
    """A request that scores its prompt computes every token, and with it checkpoints the disk
    holds already (device memory gave them up meanwhile): nothing is saved, and the disk's
    copies count as used all the same (they kept the `last_used` of their first save)."""
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path,
                                    num_state_slots=4), loaded=loaded)
    chat, chat_rows, other_rows = two_chats(engine, tmp_path, 10)
    scored = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    out = engine.generate([chat], scored)[0]
    engine.store.flush()
    assert out.num_cached_tokens == 0 and rows(tmp_path) == chat_rows | other_rows
    db = sqlite3.connect(tmp_path / "index.db")
    order = [(kind, key) for kind, key, _ in db.execute(
        "SELECT 'ckpt', hash, last_used FROM checkpoints UNION ALL "
        "SELECT 'kv', CAST(id AS TEXT), last_used FROM segments ORDER BY 3")]
    db.close()
    engine.close()
    assert set(order[:len(other_rows)]) == other_rows  # the LRU victims: the other chat's rows


def unusable_checkpoints(db: sqlite3.Connection) -> list[int]:
    """The boundaries (in blocks) of checkpoints that some block of their chain is missing for."""
    bad = []
    for tail, num_tokens in db.execute("SELECT hash, num_tokens FROM checkpoints").fetchall():
        found = db.execute("""WITH RECURSIVE up(hash) AS (
                                SELECT ? UNION SELECT b.parent FROM blocks b JOIN up
                                ON b.hash = up.hash)
                              SELECT count(*) FROM blocks WHERE hash IN (SELECT hash FROM up)""",
                           [tail]).fetchone()[0]
        if found != num_tokens // 64:
            bad.append(num_tokens // 64)
    return bad


def test_eviction_never_leaves_a_checkpoint_without_its_blocks(tiny_dirs, tmp_path):
    """A chain's rows are marked used together, so they tie for the LRU: eviction takes them from
    the chain's end back, and every checkpoint left can still be resumed, whatever the budget
    cuts (a segment under a checkpoint that stays would leave it unusable, yet counted)."""
    path = tiny_dirs["qwen3_5_text"]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path,
                                    checkpoint_interval=1),
                       loaded=load_model(path, dtype=torch.float32))
    gen = torch.Generator().manual_seed(11)
    chat = torch.randint(0, 300, (330,), generator=gen).tolist()
    engine.generate([chat[:140]], PARAMS)  # (its first segment and checkpoints)
    engine.generate([chat], PARAMS)  # (the rest, standing on them)
    engine.store.flush()
    engine.generate([chat[:200]], PARAMS)  # a fork at block 3 marks blocks 0-2 used again
    engine.store.flush()
    db = sqlite3.connect(tmp_path / "index.db")
    assert db.execute("SELECT count(*) FROM segments").fetchone()[0] >= 2
    store, seen = engine.store, []
    while (total := store.total_bytes()) > 0:
        store.evict_to(total - 1)  # one row at a time
        seen.append(unusable_checkpoints(db))
    db.close()
    engine.close()
    assert seen == [[]] * len(seen)


def test_a_segment_left_with_no_blocks_goes_before_the_rows_it_ties_with(tmp_path):
    """A segment whose blocks another process's save had inserted first (INSERT OR IGNORE left
    it no rows) holds nothing a lookup can use: of the rows saved with it, it is evicted first
    (it went last, after the checkpoint saved beside it)."""
    from statechat.cache.store import open_store

    store = open_store(tmp_path, budget_bytes=1 << 30)
    now = time.time()
    with store.db.conn:
        store.db.execute("INSERT INTO models (id, fingerprint, block_size) VALUES (1, 'f', 64)")
        for seg_id in (1, 2):
            store.db.execute("INSERT INTO segments (id, model_id, blob, num_blocks, bytes, "
                             "last_used) VALUES (?, 1, ?, 2, 100, ?)", [seg_id, f"s{seg_id}", now])
        for pos in (0, 1):  # (segment 2's two blocks were inserted by segment 1's save)
            store.db.execute("INSERT INTO blocks (hash, model_id, parent, position, segment_id, "
                             "seg_index) VALUES (?, 1, ?, ?, 1, ?)", [f"b{pos}", f"b{pos - 1}",
                                                                     pos, pos])
        store.db.execute("INSERT INTO checkpoints (hash, model_id, num_tokens, blob, bytes, "
                         "last_used, hits) VALUES ('b1', 1, 128, 'c', 100, ?, 0)", [now])
    store.evict_to(store.total_bytes() - 1)
    left = store.db.execute("SELECT id FROM segments UNION ALL SELECT hash FROM checkpoints")
    assert sorted(str(r[0]) for r in left) == ["1", "b1"]
    store.close()


def test_two_processes_evicting_at_once_free_the_overshoot_once(tmp_path):
    """Two processes on one cache dir that both find the total past the budget evict what is
    past it once between them: each sums the total again inside its deletions' transaction
    (each freed the whole overshoot it had read before, together twice as much)."""
    from statechat.cache.store import open_store

    ours, theirs = open_store(tmp_path), open_store(tmp_path)
    now = time.time()
    with ours.db.conn:
        ours.db.execute("INSERT INTO models (id, fingerprint, block_size) VALUES (1, 'f', 64)")
        for i in range(10):
            ours.db.execute("INSERT INTO checkpoints (hash, model_id, num_tokens, blob, bytes, "
                            "last_used, hits) VALUES (?, 1, 64, ?, 100, ?, 0)",
                            [f"c{i}", f"c{i}", now + i])
    budget, first_look = 700, ours.total_bytes

    def other_process_evicts_meanwhile():
        total = first_look()
        ours.total_bytes = first_look  # (once)
        theirs.evict_to(budget)
        return total

    ours.total_bytes = other_process_evicts_meanwhile
    assert ours.evict_to(budget) == 0
    assert ours.total_bytes() == budget
    ours.close()
    theirs.close()


def test_the_default_budget_counts_the_cache_s_own_bytes(tmp_path, monkeypatch):
    """The default disk budget is 10% of the free space and of the cache's own blobs: a cache
    that has filled the space it may use finds the same budget at its next start, not 10% less
    (and not nothing, on a disk it filled), so a start evicts nothing it kept."""
    import shutil

    from statechat.cache.store import open_store

    store = open_store(tmp_path, budget_bytes=1 << 30)
    with store.db.conn:
        store.db.execute("INSERT INTO models (id, fingerprint, block_size) VALUES (1, 'f', 64)")
        store.db.execute("INSERT INTO segments (id, model_id, blob, num_blocks, bytes, "
                         "last_used) VALUES (1, 1, 's1', 1, 100000, ?)", [time.time()])
    store.close()
    usage = shutil.disk_usage(tmp_path)
    for free in (900_000, 0):
        monkeypatch.setattr(shutil, "disk_usage",
                            lambda _path, free=free: usage._replace(free=free))
        again = open_store(tmp_path)
        assert again.budget == (free + 100_000) // 10
        again.close()


def test_an_eviction_leaves_no_segment_that_no_checkpoint_stands_on(tmp_path):
    """A segment whose blocks lie on no checkpoint's chain can never be resumed from: once the
    budget evicts the checkpoints above it, it goes too (it stayed, wasted space in a tiny
    budget: 130 KB of a 300 KB one). A segment that a later checkpoint still stands on stays."""
    from statechat.cache.store import open_store

    store = open_store(tmp_path, budget_bytes=1 << 30)
    rows_made = [  # (segment id, [(block, parent, position)], checkpoint at its last, when used)
        (1, [("x0", "fp", 0), ("x1", "x0", 1)], 0.0),  # a chat's first turn
        (3, [("z0", "fp", 0), ("z1", "z0", 1)], 1.0),  # another chat
        (2, [("y2", "x1", 2)], 2.0),  # the first chat's next turn, on its blocks
    ]
    now = time.time()
    with store.db.conn:
        store.db.execute("INSERT INTO models (id, fingerprint, block_size) VALUES (1, 'fp', 64)")
        for seg_id, blocks, used in rows_made:
            store.db.execute("INSERT INTO segments (id, model_id, blob, num_blocks, bytes, "
                             "last_used) VALUES (?, 1, ?, ?, 100, ?)",
                             [seg_id, f"s{seg_id}", len(blocks), now + used])
            for i, (h, parent, pos) in enumerate(blocks):
                store.db.execute("INSERT INTO blocks (hash, model_id, parent, position, "
                                 "segment_id, seg_index) VALUES (?, 1, ?, ?, ?, ?)",
                                 [h, parent, pos, seg_id, i])
            store.db.execute("INSERT INTO checkpoints (hash, model_id, num_tokens, blob, bytes, "
                             "last_used, hits) VALUES (?, 1, ?, ?, 100, ?, 0)",
                             [blocks[-1][0], 64 * (blocks[-1][2] + 1), f"c{seg_id}",
                              now + used])
        store.db.execute("UPDATE segments SET last_used = ? WHERE id = 1", [now + 2.0])  # (y2's
        # save marked the chain under it used)
    store.evict_to(450)  # the checkpoints x1 and z1 go, the least recently used
    left = store.db.execute("SELECT 'kv', id FROM segments UNION ALL "
                            "SELECT 'ckpt', hash FROM checkpoints").fetchall()
    assert sorted(map(tuple, left)) == [("ckpt", "y2"), ("kv", 1), ("kv", 2)]
    assert store.total_bytes() == 300
    store.close()
