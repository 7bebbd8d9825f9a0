"""Predicted load times track the measured ones, so a slow disk makes a request recompute.

A load's time is a fixed part (index queries, opening blobs, handing reads to threads, the pools'
copies) plus its bytes over a bandwidth. A read path slowed by an injected delay (a latency per
blob read and a slow bandwidth, as on a network disk) stands for a slow disk after a restart:
after two loads of different sizes, the predicted time of each later load, larger or smaller,
is within 3x of the time it took; and once one load has shown that a small prefix costs more to
load than to recompute, a request for one recomputes, reports no reused tokens, and gives the
no-cache tokens.
"""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from statechat.cache.store import reads
from statechat.config import EngineConfig
from statechat.engine.cost import DISK, CostModel
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model

READ_LATENCY = 0.02  # s per blob read on the slow disk
READ_BANDWIDTH = 50e6  # its bytes/s
SIZES = [3, 16, 4, 24, 5, 12]  # blocks of 64 tokens: each prompt's stored checkpoint
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
EXTRA = [7, 8, 9]  # what each request adds to a stored prompt (the same checkpoint)


def prompt(i: int, num_blocks: int) -> list[int]:
    """A prompt of `num_blocks` blocks and 8 tokens, its own from its first token."""
    return [3 + i] + [(7 * j + i) % 200 + 3 for j in range(64 * num_blocks + 7)]


@pytest.fixture(scope="module")
def saved(tiny_dirs, tmp_path_factory):
    """(model path, loaded model, a cache dir holding a checkpoint of every SIZES prompt)."""
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    cache_dir = tmp_path_factory.mktemp("saved")
    first = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=cache_dir), loaded=loaded)
    first.generate([prompt(i, n) for i, n in enumerate(SIZES)], PARAMS)
    first.close()
    return path, loaded, cache_dir


def restarted(saved, tmp_path, monkeypatch, rate: float) -> LLMEngine:
    """A new engine on a copy of the saved cache dir whose blob reads are slow, and whose
    prefill rate is `rate` s/token (held: the plans compare loads against it alone)."""
    path, loaded, cache_dir = saved
    shutil.copytree(cache_dir, tmp_path / "cache")
    read_blob = reads.read_blob

    def slow_read(blob_path, *args, **kwargs):
        time.sleep(READ_LATENCY + blob_path.stat().st_size / READ_BANDWIDTH)
        return read_blob(blob_path, *args, **kwargs)

    monkeypatch.setattr(reads, "read_blob", slow_read)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path / "cache"),
                       loaded=loaded)
    engine.prefix.cost.prefill_s_per_token = rate
    engine.prefix.cost.observe_prefill = lambda *args, **kwargs: None
    return engine


def test_predicted_loads_track_measured_ones(saved, tmp_path, monkeypatch):
    """After two loads of different sizes, every later load's prediction is within 3x of the
    time the request waited for it (a model taking all of it for bandwidth predicted a small
    load after a large one 26x too fast)."""
    engine = restarted(saved, tmp_path, monkeypatch, rate=1.0)  # recomputing never pays
    try:
        plans = [engine.generate([prompt(i, n) + EXTRA], PARAMS)[0].cache_plan
                 for i, n in enumerate(SIZES)]
    finally:
        engine.close()
    assert [p["choice"] for p in plans] == ["load"] * len(SIZES)
    ratios = [p["predicted_load_s"] / p["load_s"] for p in plans[2:]]
    assert all(1 / 3 <= r <= 3 for r in ratios), ratios


def test_a_slow_disk_makes_a_small_prefix_recompute(saved, tmp_path, monkeypatch):
    """Once a load has shown the disk slow, a short prefix that loads slower than it computes
    is recomputed: 0 tokens reported reused, the plan saying why, the no-cache tokens."""
    path, loaded, _ = saved
    engine = restarted(saved, tmp_path, monkeypatch, rate=2e-5)
    try:
        first = engine.generate([prompt(3, 24) + EXTRA], PARAMS)[0]  # the first load teaches
        small = engine.generate([prompt(0, 3) + EXTRA], PARAMS)[0]
    finally:
        engine.close()
    assert first.cache_plan["choice"] == "load" and first.cache_plan["load_s"] > READ_LATENCY
    plan = small.cache_plan
    assert plan["choice"] == "recompute" and plan["candidate_tokens"] == 192
    assert plan["predicted_load_s"] > plan["predicted_recompute_s"]
    assert small.num_cached_tokens == 0 and small.reused_from is None
    plain = LLMEngine(EngineConfig(model=path, device="cpu", enable_prefix_cache=False),
                      loaded=loaded)
    assert small.token_ids == plain.generate([prompt(0, 3) + EXTRA], PARAMS)[0].token_ids


def test_a_fixed_cost_per_load_is_not_taken_for_bandwidth():
    """Loads costing 20 ms plus 50 MB/s, seen at two sizes, predict loads of other sizes
    within 20%, both from the page cache and from the disk itself."""
    for resident in (1.0, 0.0):
        cost = CostModel(1e-5)
        for nbytes in (200e3, 1.6e6, 300e3, 2e6):
            cost.observe_load(DISK, int(nbytes), 0.02 + nbytes / 50e6, resident=resident)
        for nbytes in (100e3, 4e6):
            want = 0.02 + nbytes / 50e6
            assert cost.load_s(DISK, nbytes, resident=resident) == pytest.approx(want, rel=0.2)


def test_one_load_timed_far_too_fast_does_not_make_the_disk_look_free():
    """A disk load whose time, less the page cache's share, is left near zero (the share's
    estimate a little high) is one bad sample: two loads later, predictions are back within
    50% (it priced every disk load at 1% of its time for some 35 loads, so plans loaded
    prefixes that computing would have beaten)."""
    cost = CostModel(1e-5)
    sizes = [1 << 20, 4 << 20, 16 << 20]
    for nbytes in sizes * 4:
        cost.observe_load(DISK, nbytes, 1e-3 + nbytes / 1e9)
    cost.observe_load(DISK, 4 << 20, 1e-6)
    for nbytes in sizes[:2]:
        cost.observe_load(DISK, nbytes, 1e-3 + nbytes / 1e9)
    for nbytes in sizes:
        assert cost.load_s(DISK, nbytes) == pytest.approx(1e-3 + nbytes / 1e9, rel=0.5)
