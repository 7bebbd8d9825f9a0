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
