"""The counts a request reports come from the admission that ran: one admitted again and again
while it waits for KV blocks (each time restoring its prefix, then preempting itself) reports
what that last admission reused and computed, not the restores of the others as computed
tokens (1,737 computed for a 201-token prompt of which 192 were reused)."""

from __future__ import annotations

import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model


def test_a_request_that_waits_for_blocks_reports_what_ran(tiny_dirs):
    path = tiny_dirs["qwen3_5_text"]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", num_kv_blocks=8),
                       loaded=load_model(path, dtype=torch.float32))
    gen = torch.Generator().manual_seed(11)
    x, y = (torch.randint(0, 300, (n,), generator=gen).tolist() for n in (200, 290))
    engine.generate([x], SamplingParams(max_tokens=1))  # a checkpoint at 192 on the device
    long = engine.add_request(y, SamplingParams(max_tokens=10, ignore_eos=True))
    while not long.is_decoding:
        engine.step()
    waits = engine.add_request(x + [5], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert waits.num_preemptions > 0  # (it did wait: admitted, then out of blocks)
    out = engine.output(waits)
    assert (out.num_prompt_tokens, out.num_cached_tokens, out.num_computed_tokens) == (201, 192, 9)
