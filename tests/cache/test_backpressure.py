"""A full write-behind queue never stalls generation: the checkpoint is dropped, counted and
reported with one warning line, and the tokens are unchanged."""

from __future__ import annotations

import logging
import time

import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model


def test_full_queue_drops_and_reports(tiny_dirs, tmp_path, caplog):
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    prompt = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=path, device="cpu", enable_prefix_cache=False), loaded=loaded)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path), loaded=loaded)
    engine.store.max_pending_bytes = 0  # nothing fits: every save is refused
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        out = engine.generate([prompt], params)[0]
    engine.close()
    assert out.token_ids == plain.generate([prompt], params)[0].token_ids
    assert engine.store.dropped >= 1
    assert any("write queue is full" in r.getMessage() for r in caplog.records)
    assert engine.store.stats()["num_checkpoints"] == 0


def test_writer_holds_back_while_the_engine_launches(tiny_dirs, tmp_path, monkeypatch):
    """While the engine says it is launching a step, the writer starts nothing (it would take
    the GIL from the launches); once the engine waits or is idle, the queued saves land. A busy
    spell longer than MAX_DEFER_S delays writes but does not stop them."""
    from statechat.cache import store as store_mod

    monkeypatch.setattr(store_mod, "MAX_DEFER_S", 0.5)
    path = tiny_dirs["qwen3_5_text"]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path),
                       loaded=load_model(path, dtype=torch.float32))
    prompt = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))  # idle afterwards
    engine.store.flush()
    assert engine.store.stats()["num_checkpoints"] >= 1
    before = engine.store.stats()["num_checkpoints"]
    engine.runner.before_wait = lambda: None  # the engine stays busy after its last step
    other = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.generate([other], SamplingParams(max_tokens=1, ignore_eos=True))
    assert not engine.store.engine_idle.is_set()
    time.sleep(0.2)
    assert engine.store.stats()["num_checkpoints"] == before  # queued, held back
    engine.store.engine_busy(False)
    engine.store.flush()
    assert engine.store.stats()["num_checkpoints"] > before
    engine.close()
