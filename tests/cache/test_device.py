"""The store hands disk hits to the engine on its device and host-tier hits in host memory,
with the bytes that were saved; the writer thread moves device snapshots to pinned host
memory. Runs on the CPU and, where there is one, on a CUDA device."""

from __future__ import annotations

import pytest
import torch

from statechat.cache.store import SaveJob, open_store

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SHAPES = {"ckpt": {"conv.0": [3, 40], "ssm.0": [2, 8, 8]},
          "block": {"k.0": [64, 2, 8], "v.0": [64, 2, 8]}}
HASHES = [f"{i:02x}" * 32 for i in range(1, 6)]


def save(store, device: str) -> tuple[dict, dict]:
    """Queue and write one checkpoint (at HASHES[-1]) with the five blocks before it."""
    gen = torch.Generator().manual_seed(3)
    ckpt = {n: torch.randn(s, generator=gen) for n, s in SHAPES["ckpt"].items()}
    blocks = {n: torch.randn(len(HASHES), *s, generator=gen).to(torch.bfloat16)
              for n, s in SHAPES["block"].items()}
    ready = None
    if device == "cuda":  # as the runner does: an event after the snapshots
        event = torch.cuda.Event()
        event.record()
        ready = event.synchronize
    rows = [(h, HASHES[i - 1] if i else "00" * 32, i) for i, h in enumerate(HASHES)]
    job = SaveJob(HASHES[-1], len(HASHES) * 64, {n: t.to(device) for n, t in ckpt.items()}, rows,
                  {n: t.to(device) for n, t in blocks.items()}, ready=ready)
    assert store.save(job)
    store.flush()
    return ckpt, blocks


def attached(tmp_path, device: str, host_bytes: int):
    store = open_store(tmp_path, host_bytes=host_bytes)
    store.attach("ab" * 32, "tiny", "/nowhere", "torch.bfloat16", 64, SHAPES, device=device)
    return store


@pytest.mark.parametrize("device", DEVICES)
def test_disk_hits_arrive_on_the_device(tmp_path, device):
    first = attached(tmp_path, device, host_bytes=1 << 30)
    ckpt, blocks = save(first, device)
    host = first.load_checkpoint(HASHES[-1])  # the writer's host copies
    for t in host.values():
        assert t.device.type == "cpu" and t.is_pinned() == (device == "cuda")
    first.close()
    second = attached(tmp_path, device, host_bytes=0)
    got = second.load_checkpoint(HASHES[-1])
    for name, t in ckpt.items():
        assert got[name].device.type == device and torch.equal(got[name].cpu(), t)
    (group_hashes, tensors), = second.load_blocks([HASHES[1], HASHES[3]])
    assert group_hashes == [HASHES[1], HASHES[3]]
    for name, t in blocks.items():
        assert tensors[name].device.type == device and torch.equal(tensors[name].cpu(), t[[1, 3]])
    second.close()
