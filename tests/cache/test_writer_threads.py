"""The cache's writer thread starts no OpenMP thread team of its own: a torch CPU op large
enough to split (a copy into the host tier, rows picked out of a segment, a strided snapshot
made contiguous) would start one for that thread, and it lives as long as the writer does.
Beside it a CPU engine's decode ran 2.7 times slower (docs/bench.md, "The cache writer beside
decoding on the CPU"). What the writer saved still reads back exactly."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from statechat.cache.store import SaveJob, open_store

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="counts the process's threads in /proc")

# large enough that torch would split each copy over its threads (more than 32768 elements)
SHAPES = {"ckpt": {"conv.0": [64, 1024], "ssm.0": [2, 256, 256]},
          "block": {"k.0": [64, 16, 64], "v.0": [64, 16, 64]}}


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def snapshot(shapes: dict[str, list[int]], dtype: torch.dtype, rows: int | None = None,
             strided: bool = False) -> dict[str, torch.Tensor]:
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        full = ([rows] if rows is not None else []) + shape
        t = torch.randn(full, generator=torch.Generator().manual_seed(i)).to(dtype)
        out[name] = t.transpose(-1, -2).contiguous().transpose(-1, -2) if strided else t
    return out


@pytest.fixture
def two_torch_threads():
    """torch set to split ops over two threads (a one-core CI machine would not)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("host_bytes", [0, 16 << 20], ids=["disk only", "host tier"])
def test_saves_start_no_thread_team_in_the_writer(tmp_path, two_torch_threads, host_bytes):
    """Saves of large checkpoints and KV blocks (strided ones too, and a segment of which a
    block is already on disk, whose other rows are picked out) add no thread to the process
    while the writer lives, and read back equal."""
    store = open_store(tmp_path, host_bytes=host_bytes)
    store.attach("ab" * 32, "tiny", "/nowhere", "torch.float32", 64, SHAPES, device="cpu")
    ckpt = snapshot(SHAPES["ckpt"], torch.float32, strided=True)
    kv = snapshot(SHAPES["block"], torch.bfloat16, rows=2)
    more = snapshot(SHAPES["block"], torch.bfloat16, rows=2)
    store.flush()
    before = threads()  # (the writer's, and this thread's team, made by the snapshots, too)
    blocks = [("11" * 32, "ab" * 32, 0), ("22" * 32, "11" * 32, 64)]
    assert store.save(SaveJob("22" * 32, 128, ckpt, blocks, kv))
    store.flush()  # then a segment of which block 0 is on disk already
    assert store.save(SaveJob(None, 192, None, [blocks[1], ("33" * 32, "22" * 32, 128)], more))
    store.flush()
    assert store.errors == 0
    # (at most: a thread another test left may end meanwhile)
    assert threads() <= before, "the cache's writer started an OpenMP thread team"
    store.host.items.clear()  # (what follows reads the disk)
    got = store.load_checkpoint("22" * 32)
    assert all(torch.equal(got[n], t) for n, t in ckpt.items())
    (_, third), = [g for g in store.load_blocks(["33" * 32]) if g[0] == ["33" * 32]]
    assert all(torch.equal(third[n][0], t[1]) for n, t in more.items())
    store.close()
