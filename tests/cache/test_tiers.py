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
    plain = LLMEngine(EngineConfig(model=path, device="cpu", enable_prefix_cache=False), loaded=loaded)
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
        disk_ptr, host_ptr = t.untyped_storage().data_ptr(), in_host[name].untyped_storage().data_ptr()
        assert disk_ptr != host_ptr, f"{name} is the host tier's memory"
