"""A lookup consults every tier: with the device tier dropped, a request resumes from the host
tier (the write-behind copies); in a new engine, from disk; tokens never change."""

from __future__ import annotations

import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model

PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def test_device_then_host_then_disk(tiny_dirs, tmp_path):
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 300, (300,), generator=gen).tolist()
    edited = prompt[:280] + torch.randint(0, 300, (15,), generator=gen).tolist()
    plain = LLMEngine(EngineConfig(model=path, device="cpu", enable_prefix_cache=False),
                      loaded=loaded)
    want = plain.generate([edited], PARAMS)[0].token_ids

    config = EngineConfig(model=path, device="cpu", cache_dir=tmp_path, checkpoint_interval=2)
    engine = LLMEngine(config, loaded=loaded)
    engine.generate([prompt], PARAMS)
    device = engine.generate([edited], PARAMS)[0]
    engine.drop_device_cache()
    host = engine.generate([edited], PARAMS)[0]
    engine.close()
    disk = LLMEngine(config, loaded=loaded).generate([edited], PARAMS)[0]

    for out, tier in ((device, "device"), (host, "host"), (disk, "disk")):
        assert out.token_ids == want, tier
        assert out.reused_from == tier
        assert out.num_cached_tokens == 256  # the prompt's checkpoint before position 280


def test_a_checkpoint_read_from_disk_never_hands_out_the_host_tier(tiny_dirs, tmp_path):
    """read_checkpoint, which a restore runs on a pool thread outside the host tier's lock, reads
    the blob even when the host tier holds the same checkpoint: host-tier memory may only be
    read under that lock (the writer reuses it)."""
    path = tiny_dirs["qwen3_5_text"]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path),
                       loaded=load_model(path, dtype=torch.float32))
    engine.generate([list(range(3, 203))], PARAMS)
    engine.store.flush()
    store = engine.store
    h = next(h for kind, h in store.host.items if kind == "ckpt")  # on disk too, once flushed
    in_host, from_disk = store.load_checkpoint(h), store.read_checkpoint(h)
    engine.close()
    assert in_host.keys() == from_disk.keys()
    for name, t in from_disk.items():
        assert torch.equal(t, in_host[name])
        disk_ptr, host_ptr = (t.untyped_storage().data_ptr(),
                              in_host[name].untyped_storage().data_ptr())
        assert disk_ptr != host_ptr, f"{name} is the host tier's memory"


def test_a_plan_asks_the_page_cache_about_a_sample_of_a_long_prefixs_blobs(monkeypatch):
    """A long prefix has many blobs: the plan asks about at most RESIDENT_BLOBS of them, evenly
    spaced from the first to the deepest of each kind, and prices the rest at the mean of the
    asked ones of their kind; a short prefix's blobs are all asked."""
    from statechat.cache.store import lookup as lookup_module

    asked = []
    share = {f"kv{i}": (i % 2) * 1.0 for i in range(30)} | {f"ck{i}": 0.25 for i in range(30)}
    monkeypatch.setattr(lookup_module, "resident_fraction",
                        lambda path: asked.append(path.name) or share[path.name])
    hashes = [f"{i:04x}" for i in range(60)]
    lookup = lookup_module.Lookup({h: "disk" for h in hashes}, {h: "disk" for h in hashes[1::2]},
                                  {h: f"kv{i // 2}" for i, h in enumerate(hashes)},
                                  {h: f"ck{i}" for i, h in enumerate(hashes[1::2])})
    lookup.sample_residency(hashes)
    half = lookup_module.RESIDENT_BLOBS // 2
    kv = [n for n in asked if n.startswith("kv")]
    ck = [n for n in asked if n.startswith("ck")]
    assert len(kv) == len(ck) == half and len(set(asked)) == len(asked)
    assert {"kv0", "kv29", "ck0", "ck29"} <= set(asked)
    mean_kv = sum(share[n] for n in kv) / half
    unasked = next(h for i, h in enumerate(hashes) if f"kv{i // 2}" not in kv)
    assert lookup.cached("kv", unasked) == mean_kv and lookup.cached("ckpt", hashes[3]) == 0.25
    assert lookup.cached("kv", hashes[58]) == share["kv29"]  # asked: its own share
    assert len(asked) == lookup_module.RESIDENT_BLOBS  # pricing asked nothing more

    asked.clear()
    short = lookup_module.Lookup({h: "disk" for h in hashes[:6]}, {hashes[5]: "disk"},
                                 {h: f"kv{i // 2}" for i, h in enumerate(hashes[:6])},
                                 {hashes[5]: "ck0"})
    short.sample_residency(hashes[:6])
    assert sorted(asked) == ["ck0", "kv0", "kv1", "kv2"]


def test_the_plan_bound_is_a_lower_bound_of_every_plan():
    """The first plan (every block past the device tier's that the host tier lacks taken to be
    on disk at the best disk rate, disk checkpoints too) never costs more than the plan made
    with the disk's blocks looked up, and never turns down a prefix that plan would load:
    random prefixes mixing device, host, disk and missing blocks and checkpoints, random
    rates (the page cache sometimes slower than the disk) and latencies."""
    import random

    from statechat.cache.store import Lookup
    from statechat.engine.prefix import PrefixCache

    class Slots:
        def __init__(self, held):
            self.held = held

        def has(self, h):
            return h in self.held

    rng = random.Random(7)
    for trial in range(2000):
        n, bs = rng.randint(1, 24), 64
        hashes = [bytes([trial % 256, i]) * 4 for i in range(n)]
        hx = [h.hex() for h in hashes]
        num_device = rng.randint(0, n)
        block_tier = {h: rng.choice(["host", "disk", "disk", None]) for h in hx[num_device:]}
        ckpt_tier = {h: rng.choice(["host", "disk", None, None]) for h in hx}
        on_device = {h for h in hashes if rng.random() < 0.15}
        blob_of = {h: f"seg{i // rng.randint(1, 4)}" for i, h in enumerate(hx)}
        resident = ({f"seg{i}": rng.random() for i in range(n)}
                    | {f"ck{h}": rng.random() for h in hx})
        real = Lookup({h: t for h, t in block_tier.items() if t},
                      {h: t for h, t in ckpt_tier.items() if t},
                      {h: blob_of[h] for h, t in block_tier.items() if t == "disk"},
                      {h: f"ck{h}" for h, t in ckpt_tier.items() if t == "disk"}, resident=resident)
        first = Lookup({h: t for h, t in block_tier.items() if t == "host"}, dict(real.ckpts),
                       ckpt_blobs=dict(real.ckpt_blobs), resident=resident)
        rate = 10 ** rng.uniform(-8, -4)
        pc = PrefixCache(None, Slots(on_device), None, None, bs, rng.randint(1, 1 << 22),
                         rng.randint(1, 1 << 26), rate)
        pc.cost.bandwidth.update({t: 10 ** rng.uniform(8, 10.5)
                                  for t in ("host", "disk", "page cache")})
        pc.cost.latency.update({"host": rng.choice([0.0, 1e-5]), "disk": rng.uniform(0, 1e-3),
                                "page cache": rng.uniform(0, 1e-3)})
        num_tokens = n * bs + rng.randint(1, 100)
        k0, bound, *_ = pc._cheapest(num_tokens, hashes, hx, num_device, first, optimistic=True)
        k1, cost, *_ = pc._cheapest(num_tokens, hashes, hx, num_device, real)
        assert not k1 or bound <= cost * (1 + 1e-12), trial
        if not (k0 and bound <= num_tokens * rate):
            assert not (k1 and cost <= num_tokens * rate), trial


def test_a_regenerate_after_a_restart_copies_nothing_the_disk_holds(tiny_dirs, tmp_path):
    """After a restart, a regenerated reply (the same greedy tokens) computes again the
    checkpoint at its last block boundary, which the disk holds already: none of it is copied
    to host memory, and no blob or row is written again (it was copied to the host tier, the
    writer finding only then that the disk had it)."""
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    config = EngineConfig(model=path, device="cpu", cache_dir=tmp_path)
    prompt = list(range(5, 195))  # 190 tokens: a checkpoint at 128; the reply's at 192
    first = LLMEngine(config, loaded=loaded)
    want = first.generate([prompt], PARAMS)[0].token_ids
    first.close()
    blob_dir = tmp_path / "blobs"
    blobs = sorted(p.name for p in blob_dir.iterdir())
    again = LLMEngine(config, loaded=loaded)
    out = again.generate([prompt], PARAMS)[0]
    again.store.flush()
    host = again.store.host.stats()["host_bytes_used"]
    rows = again.store.db.execute("SELECT num_tokens FROM checkpoints ORDER BY 1").fetchall()
    again.close()
    assert out.token_ids == want
    assert (out.num_cached_tokens, out.reused_from) == (128, "disk")
    assert host == 0
    assert sorted(p.name for p in blob_dir.iterdir()) == blobs
    assert [r[0] for r in rows] == [128, 192]
