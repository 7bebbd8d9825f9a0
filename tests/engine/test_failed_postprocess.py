"""A step that fails while the scheduler takes its tokens in (postprocess raising after it
published a prefill's checkpoint: an interrupt, or an error the server's worker survives) gives
back only the checkpoint slots not yet published: a published one belongs to the prefix cache,
and released as well it was handed to the next request while still named by its boundary, whose
later reuse read that request's state (wrong tokens)."""

from __future__ import annotations

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model

SHORT = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32)


def engine(loaded, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=loaded.path, device="cpu", **kw), loaded=loaded)


def prompts(*lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in lengths]


def fail_after_publishing(eng: LLMEngine) -> None:
    """The scheduler's next publish of a checkpoint succeeds, then raises (once)."""
    publish = eng.scheduler._publish

    def failing(*args, **kwargs):
        publish(*args, **kwargs)
        eng.scheduler._publish = publish
        raise RuntimeError("failed in postprocess")

    eng.scheduler._publish = failing


@pytest.mark.parametrize("num_state_slots, reused", [(4, 0), (6, 64)])
def test_a_checkpoint_published_before_the_failure_is_kept_whole(loaded, num_state_slots, reused):
    """Prompt p fails after its checkpoint at 64 is published; prompt q then runs, and p asked
    again gives the cold tokens (its checkpoint's slot, released too, held q's state by then):
    with two free slots q's checkpoint takes the place of p's, with four p resumes at 64."""
    cached = engine(loaded, num_state_slots=num_state_slots)
    p, q = prompts(100, 100)
    fail_after_publishing(cached)
    with pytest.raises(RuntimeError, match="failed in postprocess"):
        cached.generate([p], SHORT)
    assert not cached.has_unfinished()
    cold = engine(loaded, enable_prefix_cache=False)
    assert cached.generate([q], SHORT)[0].token_ids == cold.generate([q], SHORT)[0].token_ids
    again = cached.generate([p], SHORT)[0]
    assert again.token_ids == cold.generate([p], SHORT)[0].token_ids
    assert again.num_cached_tokens == reused
