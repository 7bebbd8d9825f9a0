"""Our Qwen3.5-MoE computes the same numbers as transformers' (float32, CPU, tiny checkpoints).

Checkpoints: the multimodal layout with fused expert tensors (as the released checkpoints hold
them) and the text layout with one tensor per expert (transformers' save_pretrained default),
sharded and tied. Covers prompts of 1/65/200 tokens, prefill split with state carried into
decode, greedy generation against `generate`, both expert layouts loading to the same weights,
a clear error for a missing expert tensor, every layer sparse whatever Qwen3-MoE layer fields
the config.json carries, the multimodal checkpoint's weights under a text-only config.json,
and the Triton backend (interpreter on the CPU) against the reference on the MoE model.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

if not torch.cuda.is_available():  # before anything imports triton (see test_triton_backend.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels
from statechat.errors import ModelError
from statechat.model.loader import load_model
from tests.helpers import OneSequence, make_tiny
from tests.model.test_parity import assert_close, hf_logits, random_ids

LAYOUTS = ["qwen3_5_moe", "qwen3_5_moe_text"]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, object]:
    base = tmp_path_factory.mktemp("tiny_moe")
    return {
        "qwen3_5_moe": make_tiny(base / "mm", layout="qwen3_5", dtype="float32", moe=True),
        "qwen3_5_moe_text": make_tiny(
            base / "text",
            layout="qwen3_5_text",
            dtype="float32",
            moe=True,
            per_expert=True,
            shard_size="200KB",
            tie=True,
            seed=1,
        ),
        "per_expert_mm": make_tiny(
            base / "mm_split", layout="qwen3_5", dtype="float32", moe=True, per_expert=True
        ),
    }


def hf_model(path, layout):
    import transformers

    cls = (
        transformers.Qwen3_5MoeForConditionalGeneration
        if layout == "qwen3_5_moe"
        else transformers.Qwen3_5MoeForCausalLM
    )
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=LAYOUTS)
def pair(request, moe_dirs):
    path = moe_dirs[request.param]
    ours = load_model(path, dtype=torch.float32, device="cpu")
    return ours, hf_model(path, request.param)


def test_config_reads_the_moe_fields(pair):
    c = pair[0].config
    assert c.is_moe and c.model_type in LAYOUTS
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 32)
    assert c.shared_expert_intermediate_size == 48 and c.norm_topk_prob


@pytest.mark.parametrize("n", [1, 65, 200])
def test_prefill_logits_match_transformers(pair, n):
    ours, hf = pair
    ids = random_ids(n, ours.config.vocab_size, seed=n)
    assert_close(OneSequence(ours).step(ids, all_logits=True), hf_logits(hf, ids))


def test_split_prefill_then_decode_continues_the_state(pair):
    ours, hf = pair
    ids = random_ids(140, ours.config.vocab_size, seed=7)
    seq = OneSequence(ours)
    rows = [seq.step(ids[:65], all_logits=True), seq.step(ids[65:130], all_logits=True)]
    rows += [seq.step([t]) for t in ids[130:]]
    assert_close(torch.cat(rows), hf_logits(hf, ids))


def test_greedy_generation_matches_transformers_generate(pair):
    ours, hf = pair
    for text in ["Hello!", "def main():"]:
        ids = ours.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                eos_token_id=None,
            )
        seq, got = OneSequence(ours), []
        logits = seq.step(ids)
        for _ in range(16):
            got.append(int(logits[-1].argmax()))
            logits = seq.step([got[-1]])
        assert got == out[0, len(ids) :].tolist(), f"prompt {text!r}"


def test_per_expert_and_fused_layouts_load_the_same_weights(moe_dirs):
    fused = load_model(moe_dirs["qwen3_5_moe"], dtype=torch.float32).model.state_dict()
    split = load_model(moe_dirs["per_expert_mm"], dtype=torch.float32).model.state_dict()
    assert fused.keys() == split.keys()
    for name, value in fused.items():
        assert torch.equal(value, split[name]), name


def test_every_layer_is_sparse_whatever_the_config_says(moe_dirs, tmp_path):
    """transformers and vLLM build every Qwen3.5-MoE layer sparse: a config.json that also carries
    Qwen3-MoE's decoder_sparse_step, mlp_only_layers and a dense intermediate_size (which they do
    not read) loads its all-sparse weights and computes their numbers."""
    path = shutil.copytree(moe_dirs["qwen3_5_moe"], tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"].update(decoder_sparse_step=2, mlp_only_layers=[0], intermediate_size=96)
    (path / "config.json").write_text(json.dumps(raw))
    ours = load_model(path, dtype=torch.float32)
    ids = random_ids(70, ours.config.vocab_size, seed=4)
    want = hf_logits(hf_model(path, "qwen3_5_moe"), ids)
    assert_close(OneSequence(ours).step(ids, all_logits=True), want)


def test_text_only_config_over_multimodal_weights(moe_dirs, tmp_path):
    """A released (multimodal) checkpoint whose config.json was cut down to its text_config, as
    people do to serve the text model alone: transformers' Qwen3_5MoeForCausalLM loads its
    `model.language_model.*` tensors (ignoring the vision tower), and so do we."""
    path = shutil.copytree(moe_dirs["qwen3_5_moe"], tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    text = dict(raw["text_config"], architectures=["Qwen3_5MoeForCausalLM"],
                tie_word_embeddings=raw.get("tie_word_embeddings", False))
    (path / "config.json").write_text(json.dumps(text))
    ours = load_model(path, dtype=torch.float32)
    assert ours.config.model_type == "qwen3_5_moe_text"
    ids = random_ids(70, ours.config.vocab_size, seed=6)
    want = hf_logits(hf_model(moe_dirs["qwen3_5_moe"], "qwen3_5_moe"), ids)
    assert_close(OneSequence(ours).step(ids, all_logits=True), want)


def test_missing_expert_tensor_is_named(moe_dirs, tmp_path):
    path = shutil.copytree(moe_dirs["per_expert_mm"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.language_model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(path, dtype=torch.float32)


def test_triton_backend_matches_reference(moe_dirs):
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter must be enabled before triton is imported")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(moe_dirs["qwen3_5_moe"], dtype=torch.float32, device=device)
    ids = random_ids(74, loaded.config.vocab_size, seed=2)

    def run() -> torch.Tensor:
        seq = OneSequence(loaded, max_tokens=128)
        return torch.cat([seq.step(ids[:70], all_logits=True)] + [seq.step([t]) for t in ids[70:]])

    previous = kernels.get_backend()
    try:
        kernels.set_backend("reference")
        want = run()
        kernels.set_backend("triton")
        got = run()
    finally:
        kernels.set_backend(previous)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_a_missing_tensor_is_named_as_the_checkpoint_names_its_tensors(moe_dirs, tmp_path):
    """Under a text-only config.json over a multimodal checkpoint, a missing tensor is named
    with the `model.language_model.` prefix its files use (the name a user looks for)."""
    path = shutil.copytree(moe_dirs["qwen3_5_moe"], tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(raw["text_config"],
                                                      architectures=["Qwen3_5MoeForCausalLM"])))
    for shard in path.glob("*.safetensors"):
        tensors = load_file(shard)
        tensors.pop("model.language_model.norm.weight", None)
        save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"lacks tensor model\.language_model\.norm\.weight "):
        load_model(path, dtype=torch.float32)
