"""The host tier lives in one arena made when the store is attached: it evicts first in, first
out (a read does not keep an entry longer), no buffer spans two slabs, its budget holds, a
buffer too large for a slab is written to disk but not kept, a hit gives the saved bytes, and
a restore that holds `reading()` sees its bytes unchanged while the writer recycles regions.
On a GPU, saves of fresh prompts pin no new memory."""

from __future__ import annotations

import math
import random
import threading
import time

import pytest
import torch

from statechat.cache import arena as arena_module
from statechat.cache.arena import ALIGN, HostTier, PinnedArena
from statechat.cache.store import SaveJob, open_store
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.errors import ConfigError
from statechat.model.context import ModelCaches
from statechat.model.loader import load_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SHAPES = {"ckpt": {"conv.0": [3, 40], "ssm.0": [2, 8, 8]},
          "block": {"k.0": [64, 2, 8], "v.0": [64, 2, 8]}}
CKPT_BYTES = 3 * 40 * 4 + 2 * 8 * 8 * 4  # 992: one region of ALIGN * 2 bytes per checkpoint
BLOCK_BYTES = 2 * 64 * 2 * 8 * 2  # bfloat16 keys and values of one block


def snapshot(shapes: dict[str, list[int]], dtype: torch.dtype, seed: int, rows: int | None = None):
    """Random tensors as views of one buffer, as the runner's snapshots are."""
    full = {n: ([rows] if rows is not None else []) + s for n, s in shapes.items()}
    sizes = [math.prod(s) * dtype.itemsize for s in full.values()]
    buf = torch.empty(sum(sizes), dtype=torch.uint8)
    out, offset = {}, 0
    gen = torch.Generator().manual_seed(seed)
    for (name, shape), size in zip(full.items(), sizes):
        out[name] = buf[offset : offset + size].view(dtype).view(shape)
        out[name].copy_(torch.randn(shape, generator=gen).to(dtype))
        offset += size
    return out


def ckpt_hash(i: int) -> str:
    return f"{i + 1:02x}" * 32


def attached(tmp_path, host_bytes: int, device: str = "cpu"):
    store = open_store(tmp_path, host_bytes=host_bytes)
    store.attach("ab" * 32, "tiny", "/nowhere", "torch.bfloat16", 64, SHAPES, device=device)
    return store


def save_ckpt(store, i: int) -> dict[str, torch.Tensor]:
    """Save checkpoint i (one buffer of CKPT_BYTES) and wait for it; a copy of its tensors."""
    ckpt = snapshot(SHAPES["ckpt"], torch.float32, seed=i)
    want = {n: t.clone() for n, t in ckpt.items()}
    assert store.save(SaveJob(ckpt_hash(i), 64 * (i + 1), ckpt))
    store.flush()
    return want


def tiers(store, n: int) -> list[str]:
    return [store.where([], [ckpt_hash(i)]).ckpts[ckpt_hash(i)] for i in range(n)]


def test_the_ring_evicts_first_in_first_out(tmp_path):
    """Room for four checkpoints: the fifth and sixth replace the first and second, although
    the first was read just before (an LRU would have kept it); evicted ones load from disk."""
    store = attached(tmp_path, host_bytes=4 * 2 * ALIGN)
    saved = [save_ckpt(store, i) for i in range(4)]
    assert tiers(store, 4) == ["host"] * 4
    with store.reading():
        store.load_checkpoint(ckpt_hash(0))
    saved += [save_ckpt(store, i) for i in (4, 5)]
    assert tiers(store, 6) == ["disk"] * 2 + ["host"] * 4
    for i, want in enumerate(saved):
        got = store.load_checkpoint(ckpt_hash(i))
        assert all(torch.equal(got[n], t) for n, t in want.items())
    store.close()


def test_no_region_spans_two_slabs_and_live_regions_never_overlap():
    arena = PinnedArena(8 * 1024, pin=False, slab_bytes=2048)
    assert len(arena.slabs) == 4 and arena.capacity == 8 * 1024
    rng = random.Random(0)
    live, last_slab = [], 0
    for _ in range(2000):
        got = arena.allocate(rng.randint(1, 2048))
        region, overlapped = got
        assert region.end <= arena.slab_bytes and region.start % ALIGN == 0
        assert region.slab in (last_slab, (last_slab + 1) % 4)  # the ring moves slab by slab
        last_slab = region.slab
        live = [r for r in live if r not in overlapped]
        # what it overlapped was all there is to evict: the rest stays disjoint from it
        assert not [r for r in live if r.slab == region.slab and r.start < region.end
                    and region.start < r.end]
        live.append(region)
        assert sum(r.nbytes for r in live) <= arena.capacity
    assert arena.allocate(2049) is None


def test_host_tier_keeps_saved_bytes_within_its_budget():
    """Saves of random sizes through one small ring: every entry still held has exactly the
    bytes it was saved with, and the bytes held never exceed the capacity."""
    host = HostTier(16 * 1024)
    host.reserve(torch.device("cpu"))
    rng = random.Random(1)
    saved = {}
    for i in range(300):
        h = f"{i:064x}"
        ckpt = {"a": torch.randn(rng.randint(1, 1500)), "b": torch.randn(rng.randint(0, 600))}
        saved[h] = {n: t.clone() for n, t in ckpt.items()}
        host.keep(h, ckpt, [], {})
        held = [k for _, k in host.items]
        assert h in held
        for k in held:
            got = host.get("ckpt", k)
            assert all(torch.equal(got[n], t) for n, t in saved[k].items())
        stats = host.stats()
        assert 0 < stats["host_bytes_used"] <= stats["host_bytes_capacity"] <= 16 * 1024


def test_a_buffer_larger_than_a_slab_is_written_but_not_kept(tmp_path):
    """Five blocks do not fit the one slab: the checkpoint is kept, the blocks only go to disk,
    and they load from there with the bytes saved."""
    store = attached(tmp_path, host_bytes=4 * BLOCK_BYTES)
    ckpt = snapshot(SHAPES["ckpt"], torch.float32, seed=1)
    blocks = snapshot(SHAPES["block"], torch.bfloat16, seed=2, rows=5)
    hashes = [f"{i + 16:02x}" * 32 for i in range(5)]
    rows = [(h, hashes[i - 1] if i else "00" * 32, i) for i, h in enumerate(hashes)]
    assert store.save(SaveJob(hashes[-1], 5 * 64, dict(ckpt), rows, dict(blocks)))
    store.flush()
    found = store.where(hashes, [hashes[-1]])
    assert set(found.blocks.values()) == {"disk"} and found.ckpts == {hashes[-1]: "host"}
    (got_hashes, got), = store.load_blocks(hashes)
    assert got_hashes == hashes
    assert all(torch.equal(got[n], t) for n, t in blocks.items())
    assert 0 < store.stats()["host_bytes_used"] <= store.stats()["host_bytes_capacity"]
    assert store.stats()["host_bytes_not_kept"] == 5 * BLOCK_BYTES  # counted, not silent
    store.close()


def test_a_snapshot_larger_than_a_slab_is_kept_tensor_by_tensor(tmp_path, monkeypatch):
    """Five blocks are one snapshot buffer larger than a slab, but each layer's keys or values
    fit one: they are kept, each tensor in its own region, and hit with the bytes saved."""
    monkeypatch.setattr(arena_module, "SLAB_BYTES", 3 * BLOCK_BYTES)
    store = attached(tmp_path, host_bytes=4 * 3 * BLOCK_BYTES)
    assert store.host.arena.slab_bytes == 3 * BLOCK_BYTES < 5 * BLOCK_BYTES
    blocks = snapshot(SHAPES["block"], torch.bfloat16, seed=3, rows=5)
    hashes = [f"{i + 40:02x}" * 32 for i in range(5)]
    rows = [(h, hashes[i - 1] if i else "00" * 32, i) for i, h in enumerate(hashes)]
    assert store.save(SaveJob(None, 5 * 64, None, rows, dict(blocks)))
    store.flush()
    assert set(store.where(hashes, []).blocks.values()) == {"host"}
    (got_hashes, got), = store.load_blocks(hashes)
    assert got_hashes == hashes and all(torch.equal(got[n], t) for n, t in blocks.items())
    assert store.stats()["host_bytes_not_kept"] == 0
    store.close()


@pytest.mark.parametrize("device", DEVICES)
def test_host_hits_give_the_saved_bytes(tmp_path, device):
    store = attached(tmp_path, host_bytes=1 << 20, device=device)
    ckpt = snapshot(SHAPES["ckpt"], torch.float32, seed=3)
    blocks = snapshot(SHAPES["block"], torch.bfloat16, seed=4, rows=4)
    hashes = [f"{i + 32:02x}" * 32 for i in range(4)]
    rows = [(h, hashes[i - 1] if i else "00" * 32, i) for i, h in enumerate(hashes)]
    ready = None
    if device == "cuda":  # as the runner does: an event after the snapshots
        event = torch.cuda.Event()
        event.record()
        ready = event.synchronize
    job = SaveJob(hashes[-1], 4 * 64, {n: t.to(device) for n, t in ckpt.items()}, rows,
                  {n: t.to(device) for n, t in blocks.items()}, ready=ready)
    assert store.save(job)
    store.flush()
    found = store.where(hashes, [hashes[-1]])
    assert set(found.blocks.values()) == {"host"} and found.ckpts == {hashes[-1]: "host"}
    with store.reading():
        got = store.load_checkpoint(hashes[-1])
        assert all(torch.equal(got[n], t) for n, t in ckpt.items())
        (got_hashes, got), = store.load_blocks([hashes[1], hashes[2]])
        assert got_hashes == [hashes[1], hashes[2]]
        assert all(torch.equal(got[n], t[1:3]) for n, t in blocks.items())
    stats = store.stats()
    assert stats["host_bytes_capacity"] == 1 << 20 and stats["host_bytes_used"] > 0
    store.close()


def test_no_host_tier_keeps_nothing(tmp_path):
    store = attached(tmp_path, host_bytes=0)
    saved = [save_ckpt(store, i) for i in range(2)]
    assert tiers(store, 2) == ["disk", "disk"]
    assert store.host.arena is None
    assert store.stats()["host_bytes_capacity"] == store.stats()["host_bytes_used"] == 0
    got = store.load_checkpoint(ckpt_hash(1))
    assert all(torch.equal(got[n], t) for n, t in saved[1].items())
    store.close()


def test_a_reader_keeps_its_bytes_until_it_lets_go(tmp_path):
    """Room for one checkpoint: a save that needs the region a restore is reading waits until
    the restore lets go, then replaces it."""
    store = attached(tmp_path, host_bytes=2 * ALIGN)
    first = save_ckpt(store, 0)
    with store.reading():
        assert tiers(store, 1) == ["host"]
        got = store.load_checkpoint(ckpt_hash(0))
        second = snapshot(SHAPES["ckpt"], torch.float32, seed=1)
        assert store.save(SaveJob(ckpt_hash(1), 128, {n: t.clone() for n, t in second.items()}))
        time.sleep(0.3)  # the writer has the job, and waits
        assert store.queue.unfinished_tasks == 1
        assert all(torch.equal(got[n], t) for n, t in first.items())
    store.flush()
    assert tiers(store, 2) == ["disk", "host"]
    got = store.load_checkpoint(ckpt_hash(1))
    assert all(torch.equal(got[n], t) for n, t in second.items())
    store.close()


@pytest.mark.parametrize("device", DEVICES)
def test_restores_from_a_recycling_ring_give_the_no_cache_tokens(tiny_dirs, tmp_path, device):
    """A host tier of room for a few saves, pools too small to keep every prefix on the device,
    and requests that return to earlier prefixes while the writer still fills the ring: they
    resume from the host tier (some) and always give the no-cache tokens."""
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32, device=device)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    gen = torch.Generator().manual_seed(11)
    bases = [torch.randint(3, 300, (300,), generator=gen).tolist() for _ in range(4)]
    prompts = []
    for turn in range(3):
        for base in bases:
            tail = torch.randint(3, 300, (20 + turn,), generator=gen).tolist()
            prompts.append(base[: 260 - 30 * turn] + tail)
    common = {"model": path, "device": device, "dtype": "float32", "num_kv_blocks": 12,
              "num_state_slots": 8, "use_graphs": False}
    plain = LLMEngine(EngineConfig(**common, enable_prefix_cache=False), loaded=loaded)
    want = [plain.generate([p], params)[0].token_ids for p in prompts]
    per_save = (2 * ModelCaches.bytes_per_block(loaded.config, torch.float32, 64)
                + ModelCaches.bytes_per_slot(loaded.config, torch.float32) + 2 * ALIGN)
    engine = LLMEngine(EngineConfig(**common, cache_dir=tmp_path / "cache", checkpoint_interval=2,
                                    host_cache_bytes=3 * per_save), loaded=loaded)
    engine.prefix.cost.prefill_s_per_token = 1.0  # loading always wins: restores are exercised
    engine.prefix.cost.observe_prefill = lambda *timed: None
    outs = [engine.generate([p], params)[0] for p in prompts]
    engine.close()
    assert [o.token_ids for o in outs] == want
    assert any(o.reused_from == "host" for o in outs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_saves_of_fresh_prompts_pin_no_new_memory(tiny_dirs, tmp_path):
    """The arena is pinned when the engine starts; saves after that call no cudaHostAlloc."""
    stats = getattr(torch.cuda, "host_memory_stats", dict)
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32, device="cuda")
    config = EngineConfig(model=path, device="cuda", dtype="float32", cache_dir=tmp_path,
                          checkpoint_interval=2, host_cache_bytes=64 << 20)
    engine = LLMEngine(config, loaded=loaded)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    gen = torch.Generator().manual_seed(12)
    fresh = [torch.randint(3, 300, (400,), generator=gen).tolist() for _ in range(9)]
    engine.generate([fresh[0]], params)  # first use (the restore staging is pinned at attach)
    engine.store.flush()
    before = stats().get("num_host_alloc")  # torch reports it once something was pinned
    if before is None:
        engine.close()
        pytest.skip("this torch does not report host allocations")
    for prompt in fresh[1:]:
        engine.generate([prompt], params)
    engine.store.flush()
    assert stats()["num_host_alloc"] == before
    assert engine.store.stats()["num_checkpoints"] >= 8 * 3
    engine.close()


def test_reads_racing_the_writer_see_the_saved_bytes(tmp_path):
    """A thread reading host-tier hits while the writer recycles a six-entry ring always reads
    the bytes that were saved."""
    store = attached(tmp_path, host_bytes=6 * 2 * ALIGN)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    done, wrong, hits = threading.Event(), [], []

    def read() -> None:
        while not done.is_set():
            for i in list(saved):
                with store.reading():
                    if store.host.has("ckpt", ckpt_hash(i)):
                        got = store.load_checkpoint(ckpt_hash(i))
                        hits.append(i)
                        if not all(torch.equal(got[n], t) for n, t in saved[i].items()):
                            wrong.append(i)

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(40):
        ckpt = snapshot(SHAPES["ckpt"], torch.float32, seed=i)
        saved[i] = {n: t.clone() for n, t in ckpt.items()}
        assert store.save(SaveJob(ckpt_hash(i), 64, ckpt))
    store.flush()
    done.set()
    reader.join()
    assert hits and not wrong
    assert tiers(store, 40) == ["disk"] * 34 + ["host"] * 6
    store.close()


def test_stats_during_a_restore_do_not_deadlock(tmp_path):
    """A restore holds the host tier while it reads the index; asking for stats meanwhile (a
    status line) must not take the two locks in the other order."""
    store = attached(tmp_path, host_bytes=64 * 1024)
    save_ckpt(store, 0)
    in_restore, done = threading.Event(), []

    def restore():
        with store.reading():
            in_restore.set()
            time.sleep(0.2)  # stats() runs meanwhile
            with store.db_lock:  # what load_blocks / _touch take inside a restore
                done.append("restore")

    reader = threading.Thread(target=restore, daemon=True)
    reader.start()
    in_restore.wait(5)
    def ask():
        done.append(store.stats()["host_bytes_capacity"])

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    reader.join(10)
    asker.join(10)
    assert not reader.is_alive() and not asker.is_alive(), "stats() and a restore deadlocked"
    assert "restore" in done and 64 * 1024 in done
    store.close()


def test_a_host_tier_that_cannot_be_allocated_is_one_clear_error(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(arena_module.torch, "empty", refuse)
    with pytest.raises(ConfigError, match="lower host_cache_bytes"):
        PinnedArena(1 << 20, pin=True)
