"""The weights' part of the cache's model fingerprint tells apart two checkpoints of one
architecture (a model and its fine-tune: the same config, tensor names and shapes, other
values), so that they never reuse each other's cached states from one cache dir; a copy of a
checkpoint keeps its fingerprint (its cache stays usable after the folder moves)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model import loader
from statechat.model.loader import load_model
from tests.helpers import make_tiny

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def fine_tune(src, dst, change):
    """A copy of the one-file checkpoint `src` whose tensors `change` edits in place."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("whole_bytes, windows", [(1 << 20, (16, 1024)), (256, (4, 16))])
def test_same_shapes_other_values_is_another_model(tiny_dirs, tmp_path, monkeypatch, whole_bytes,
                                                   windows):
    """Also where the tensors are sampled rather than read whole (a large model's): with a
    `whole_bytes` of 256 and four windows of 16 bytes, every tensor of the tiny model is, and
    the windows leave most of its bytes unread."""
    monkeypatch.setattr(loader, "WHOLE_TENSOR_BYTES", whole_bytes)
    monkeypatch.setattr(loader, "NUM_WINDOWS", windows[0])
    monkeypatch.setattr(loader, "WINDOW_BYTES", windows[1])
    base = tiny_dirs["qwen3_5"]
    other_seed = make_tiny(tmp_path / "seed7", layout="qwen3_5", dtype="float32", seed=7)

    def nudge_norm(tensors):  # one small tensor: a norm's weights, every value moved
        name = next(n for n in sorted(tensors) if n.endswith("norm.weight"))
        tensors[name] = tensors[name] + 0.5

    def merge_delta(tensors):  # one large matrix, every value moved a little (a merged LoRA)
        name = max(sorted(tensors), key=lambda n: tensors[n].numel())
        gen = torch.Generator().manual_seed(3)
        tensors[name] = tensors[name] + 1e-3 * torch.randn(tensors[name].shape, generator=gen)

    digest = load_model(base, dtype=torch.float32).weights_digest
    assert load_model(shutil.copytree(base, tmp_path / "copy"),
                      dtype=torch.float32).weights_digest == digest
    for other in (other_seed, fine_tune(base, tmp_path / "norm", nudge_norm),
                  fine_tune(base, tmp_path / "delta", merge_delta)):
        assert load_model(other, dtype=torch.float32).weights_digest != digest, other


def test_a_fine_tune_on_the_same_cache_dir_reuses_nothing_of_its_base(tiny_dirs, tmp_path):
    """Greedy tokens of the fine-tune with a cache its base filled equal its own with no
    cache, and it reports no reused token."""
    base = tiny_dirs["qwen3_5"]
    tuned = make_tiny(tmp_path / "tuned", layout="qwen3_5", dtype="float32", seed=7)
    prompt = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = tmp_path / "cache"
    first = LLMEngine(EngineConfig(model=base, device="cpu", cache_dir=cache))
    first.generate([prompt], PARAMS)
    first.close()
    loaded = load_model(tuned, dtype=torch.float32)
    plain = LLMEngine(EngineConfig(model=tuned, device="cpu", enable_prefix_cache=False),
                      loaded=loaded)
    want = plain.generate([prompt], PARAMS)[0].token_ids
    cached = LLMEngine(EngineConfig(model=tuned, device="cpu", cache_dir=cache), loaded=loaded)
    out = cached.generate([prompt], PARAMS)[0]
    cached.close()
    assert (out.token_ids, out.num_cached_tokens) == (want, 0)


def test_sampled_windows_leave_the_rest_unread(tiny_dirs, tmp_path, monkeypatch):
    """The sampled form reads only its windows (so a model of many gigabytes is not read a
    second time): a value changed between two windows of a large tensor is not seen, one in
    a window is (the limit docs/cache-schema.md states)."""
    monkeypatch.setattr(loader, "WHOLE_TENSOR_BYTES", 256)
    monkeypatch.setattr(loader, "NUM_WINDOWS", 2)  # (the first and the last 16 bytes)
    monkeypatch.setattr(loader, "WINDOW_BYTES", 16)
    base = tiny_dirs["qwen3_5"]
    name = max(sorted(load_file(base / "model.safetensors")),
               key=lambda n: load_file(base / "model.safetensors")[n].numel())

    def middle(tensors):
        tensors[name].view(-1)[tensors[name].numel() // 2] += 1.0

    def first(tensors):
        tensors[name].view(-1)[0] += 1.0

    digest = load_model(base, dtype=torch.float32).weights_digest
    assert load_model(fine_tune(base, tmp_path / "mid", middle),
                      dtype=torch.float32).weights_digest == digest
    assert load_model(fine_tune(base, tmp_path / "first", first),
                      dtype=torch.float32).weights_digest != digest
