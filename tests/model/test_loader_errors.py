"""Each bad checkpoint a user can hand us ends in one line that names the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from statechat.errors import ModelError
from statechat.model.loader import load_model


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def error_of(path) -> str:
    with pytest.raises(ModelError) as info:
        load_model(path, dtype=torch.float32)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_missing_directory(tmp_path):
    assert "does not exist" in error_of(tmp_path / "nope")


def test_a_file_given_as_the_model_is_named_a_file(tmp_path):
    """`--model requests.jsonl` (a file that exists) is not reported as missing."""
    given = tmp_path / "requests.jsonl"
    given.write_text("{}\n")
    assert error_of(given) == (f"{given} is a file, not a model directory (a Hugging Face "
                               "checkpoint directory with config.json)")


def test_no_config_json(tmp_path):
    assert "no config.json" in error_of(tmp_path)


def test_bad_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert "not valid JSON" in error_of(tmp_path)


def test_unsupported_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "'llama'" in error_of(tmp_path)


def test_moe_checkpoint_loads(tmp_path):
    from tests.helpers import make_tiny

    path = make_tiny(tmp_path / "moe", layout="qwen3_5", dtype="float32", moe=True)
    loaded = load_model(path, dtype=torch.float32)
    assert loaded.config.model_type == "qwen3_5_moe" and loaded.config.num_experts == 8
    experts = loaded.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (8, 64, 64) and experts.down_proj.shape == (8, 64, 32)


def test_moe_config_lacking_expert_fields_is_named(tiny_dirs, tmp_path):
    path = copy_ckpt(tiny_dirs["qwen3_5_text"], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_5_moe_text"}))
    assert "'num_experts'" in error_of(path)


def test_missing_tensor_is_named(tiny_dirs, tmp_path):
    path = copy_ckpt(tiny_dirs["qwen3_5"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.language_model.layers.1.linear_attn.A_log"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert "model.language_model.layers.1.linear_attn.A_log" in error_of(path)


def test_missing_tensor_of_a_text_layout_is_named_as_its_files_name_it(tiny_dirs, tmp_path):
    path = copy_ckpt(tiny_dirs["qwen3_5_text"], tmp_path / "m")
    shard = weights(path)
    tensors = load_file(shard)
    name = next(n for n in tensors if n.startswith("model.layers."))
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    assert error_of(path) == f"checkpoint lacks tensor {name} (1 missing in all)"


def test_missing_tensor_is_named_as_most_of_the_files_name_theirs(tiny_dirs, tmp_path):
    """A checkpoint whose tensors sit under model.language_model. but one under model. (read
    last: the files are read in name order): the missing tensor was named after that one."""
    path = copy_ckpt(tiny_dirs["qwen3_5"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.language_model.layers.1.linear_attn.A_log"]
    tensors["model.norm.weight"] = tensors.pop("model.language_model.norm.weight")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert error_of(path) == ("checkpoint lacks tensor "
                              "model.language_model.layers.1.linear_attn.A_log (1 missing in all)")


def test_shape_mismatch_names_tensor_and_shapes(tiny_dirs, tmp_path):
    path = copy_ckpt(tiny_dirs["qwen3_5"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.language_model.norm.weight"] = torch.zeros(7)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    msg = error_of(path)
    assert "model.language_model.norm.weight" in msg and "[7]" in msg and "[64]" in msg


def test_missing_shard_is_named(tiny_dirs, tmp_path):
    path = copy_ckpt(tiny_dirs["qwen3_5_text"], tmp_path / "m")
    (path / "model-00002-of-00009.safetensors").unlink()
    assert "model-00002-of-00009.safetensors" in error_of(path)


def test_a_pytorch_bin_checkpoint_is_named(tiny_dirs, tmp_path):
    """A checkpoint of `pytorch_model.bin` only: the error says what it has and what to get."""
    path = copy_ckpt(tiny_dirs["qwen3_5"], tmp_path / "m")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    (path / "optimizer.pt").write_bytes(b"")  # (the weights are named, not a training file)
    (path / "adapter.bin").write_bytes(b"")
    assert error_of(path) == (f"{path} holds no *.safetensors weights (it has pytorch_model.bin: "
                              "statechat reads safetensors checkpoints only; download the "
                              "model's safetensors release)")


def test_missing_tokenizer_files(tiny_dirs, tmp_path):
    path = copy_ckpt(tiny_dirs["qwen3_5"], tmp_path / "m")
    (path / "tokenizer.json").unlink()
    assert "no tokenizer files" in error_of(path)


def test_ignores_visual_and_mtp_and_loads_bf16_into_float32(tiny_dirs):
    loaded = load_model(tiny_dirs["qwen3_5"], dtype=torch.float32)
    names = [n for n, _ in loaded.model.named_parameters()]
    assert not any("visual" in n or "mtp" in n for n in names)
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())


def test_embedded_model_loads_from_bf16():
    from statechat.paths import EMBEDDED_MODEL

    loaded = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    assert loaded.config.model_type == "qwen3_5_text"
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def weights(path):
    return min(path.glob("*.safetensors"))


def edited(tiny_dirs, tmp_path, edit) -> str:
    """The error of the text-only tiny checkpoint with `edit(config dict, path)` applied."""
    path = copy_ckpt(tiny_dirs["qwen3_5_text"], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg, path)
    (path / "config.json").write_text(json.dumps(cfg))
    return error_of(path)


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda c, p: c.update(num_hidden_layers="8"),
         "'num_hidden_layers' must be a positive integer, got '8'"),
        (lambda c, p: c.update(num_key_value_heads=0),
         "'num_key_value_heads' must be a positive integer"),
        (lambda c, p: c.update(rope_parameters=[1]), "a field of an unexpected type or value"),
        (lambda c, p: c.update(full_attention_interval=0, layer_types=None),
         "'full_attention_interval' must be a positive integer"),
        (lambda c, p: (p / "generation_config.json").write_text('{"eos_token_id": "x"}'),
         "generation_config.json field 'eos_token_id' must be an integer or a list of integers"),
        (lambda c, p: (c.update(eos_token_id=[2, None]),
                       (p / "generation_config.json").unlink()),
         "config.json field 'eos_token_id' must be an integer or a list of integers"),
        (lambda c, p: weights(p).write_bytes(b""), "cannot be read"),
        (lambda c, p: weights(p).write_bytes(weights(p).read_bytes()[:5000]),
         "-00001-of-00009.safetensors cannot be read (Error while deserializing header"),
        (lambda c, p: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
         "config.json asks for rope_type 'yarn', which statechat does not support"),
        (lambda c, p: c.update(max_position_embeddings=0),
         "'max_position_embeddings' must be a positive integer, got 0"),
        (lambda c, p: c.update(linear_conv_kernel_dim="4"),
         "'linear_conv_kernel_dim' must be a positive integer, got '4'"),
    ],
    ids=["layers-a-string", "no-kv-heads", "rope-a-list", "interval-0", "eos-a-string",
         "eos-a-null", "empty-weights", "cut-weights", "yarn", "no-positions", "conv-a-string"],
)
def test_fields_and_files_of_the_wrong_shape_are_named(tiny_dirs, tmp_path, edit, says):
    """Values that once raised a TypeError, a ZeroDivisionError or the safetensors error, or
    were taken (no positions: every prompt refused; a string: the tokenizer's error)."""
    assert says in edited(tiny_dirs, tmp_path, edit)


def test_a_field_statechat_does_not_read_is_named_with_its_reason(tiny_dirs, tmp_path):
    """transformers refuses it while picking the tokenizer: the error once blamed the tokenizer
    and ended at "Validation error for field 'attention_dropout':", without the reason."""
    says = edited(tiny_dirs, tmp_path, lambda c, p: c.update(attention_dropout="x"))
    assert says.startswith(f"{tmp_path / 'm' / 'config.json'} has a value transformers refuses")
    assert "'attention_dropout' with value 'x'" in says and "tokenizer" not in says


def test_config_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    assert "must hold a JSON object" in error_of(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{")
    assert "cannot be read" in error_of(tmp_path)


def edited_weights(tiny_dirs, tmp_path, edit) -> str:
    """The error of the multimodal tiny checkpoint with `edit(tensors)` applied to its weights."""
    path = copy_ckpt(tiny_dirs["qwen3_5"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return error_of(path)


NORM = "model.language_model.norm.weight"
DOWN = "model.language_model.layers.0.mlp.down_proj.weight"
BIAS = "model.language_model.layers.3.self_attn.q_proj.bias"


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda t: t.update({NORM: t[NORM].to(torch.int32)}), f"tensor {NORM} is stored as int32"),
        (lambda t: t.update({DOWN: t[DOWN].to(torch.float8_e4m3fn)}),
         f"tensor {DOWN} is stored as float8_e4m3fn"),
        (lambda t: t.update({DOWN + "_scale_inv": torch.ones(1)}),
         f"checkpoint has tensor {DOWN}_scale_inv, which a qwen3_5 model"),
        (lambda t: t.update({BIAS: torch.zeros(4)}), f"checkpoint has tensor {BIAS}"),
    ],
    ids=["int32", "float8", "quantization-scale", "unknown-bias"],
)
def test_tensors_the_model_cannot_use_are_named(tiny_dirs, tmp_path, edit, says):
    """Once converted or skipped without a word: the model ran with garbage or without them."""
    assert says in edited_weights(tiny_dirs, tmp_path, edit)


def test_a_tied_checkpoint_may_still_store_its_lm_head(tiny_dirs, tmp_path):
    path = copy_ckpt(tiny_dirs["qwen3_5"], tmp_path / "m")  # (untied: it stores lm_head.weight)
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(path, dtype=torch.float32)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight


def test_a_directory_named_like_weights_is_not_a_file(tiny_dirs, tmp_path):
    path = copy_ckpt(tiny_dirs["qwen3_5"], tmp_path / "m")
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").mkdir()
    assert "weight shard model.safetensors is not a file in" in error_of(path)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/hostname", "a/../../b", 7])
def test_an_index_cannot_name_a_shard_outside_the_checkpoint(tiny_dirs, tmp_path, name):
    path = copy_ckpt(tiny_dirs["qwen3_5_text"], tmp_path / "m")
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = name
    index.write_text(json.dumps(data))
    msg = error_of(path)
    assert "weight shard" in msg and repr(name) in msg


def test_a_shard_may_be_a_link_to_a_file_elsewhere(tiny_dirs, tmp_path):
    # the Hugging Face cache's snapshot folders hold links into its blobs folder
    path = copy_ckpt(tiny_dirs["qwen3_5_text"], tmp_path / "m")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shard = path / "model-00002-of-00009.safetensors"
    shard.rename(blobs / "abc")
    shard.symlink_to(blobs / "abc")
    load_model(path, dtype=torch.float32)
