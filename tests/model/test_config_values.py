"""config.json values: a null optional field means its default (as a missing one does), the
configs transformers itself writes for Qwen3.5 load with the same numbers, and a value the model
cannot run (a zero eps, a rotary dimension of 0, a string where a boolean goes, ...) ends in one
line that names the file and the field, from ModelConfig.from_hf and from `statechat run`."""

from __future__ import annotations

import json
import shutil

import pytest

from statechat.errors import ModelError
from statechat.model.config import ModelConfig
from statechat.paths import EMBEDDED_MODEL


def write(tmp_path, cfg: dict):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def embedded() -> dict:
    return json.loads((EMBEDDED_MODEL / "config.json").read_text())


def config_of(tmp_path, edit) -> ModelConfig:
    cfg = embedded()
    edit(cfg)
    return ModelConfig.from_hf(write(tmp_path, cfg))


def error_of(tmp_path, edit) -> str:
    with pytest.raises(ModelError) as info:
        config_of(tmp_path, edit)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(str(tmp_path / "config.json")), msg
    return msg


def rope(**fields):
    return lambda c: c["rope_parameters"].update(fields)


def no_layer_types(**fields):
    return lambda c: (c.pop("layer_types"), c.update(fields))


def test_a_null_interval_means_the_default_of_4(tmp_path):
    """(It was refused: "must be a positive integer, got None".)"""
    assert (config_of(tmp_path, no_layer_types(full_attention_interval=None)).layer_types
            == config_of(tmp_path, no_layer_types()).layer_types
            == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3
            + ("full_attention",))


@pytest.mark.parametrize("interval", [0, "x", None, 3])
def test_the_interval_does_not_matter_where_layer_types_are_given(tmp_path, interval):
    """As transformers reads it: only a config without layer_types is built from the interval."""
    given = embedded()["layer_types"]
    assert list(config_of(tmp_path, lambda c: c.update(full_attention_interval=interval))
                .layer_types) == given


@pytest.mark.parametrize(("edit", "default"), [
    (lambda c: c.update(rms_norm_eps=None), ("rms_norm_eps", 1e-6)),
    (rope(rope_theta=None), ("rope_theta", 10000.0)),
    (rope(partial_rotary_factor=None), ("partial_rotary_factor", 0.25)),
    (lambda c: c.update(head_dim=None), ("head_dim", 256)),
    (lambda c: c.update(tie_word_embeddings=None), ("tie_word_embeddings", False)),
], ids=["eps", "theta", "factor", "head-dim", "tie"])
def test_a_null_optional_field_means_its_default(tmp_path, edit, default):
    key, value = default
    assert getattr(config_of(tmp_path, edit), key) == value


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_configs_transformers_writes_load_with_its_numbers(tmp_path, moe):
    """Its Qwen3.5 defaults (those of the released checkpoints), and a config without head_dim:
    transformers' head_dim is then 256, not hidden_size / heads (it was 1024 / 8 = 128 here)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    theirs = (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(hidden_size=1024,
                                                                  num_attention_heads=8)
    cfg = theirs.to_dict()
    cfg.pop("head_dim")
    ours = ModelConfig.from_hf(write(tmp_path, cfg))
    assert ours.layer_types == tuple(theirs.layer_types)
    assert ours.head_dim == theirs.head_dim == 256
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"]
    assert ours.rotary_dim == 64


@pytest.mark.parametrize(("edit", "says"), [
    (lambda c: c.update(full_attention_interval=0, layer_types=None),
     "field 'full_attention_interval' must be a positive integer, got 0"),
    (lambda c: c.update(rms_norm_eps=0.0), ("field 'rms_norm_eps' must be a number above 0, "
     "got 0.0 (leave it out for the default, 1e-06)")),
    (lambda c: c.update(rms_norm_eps=-1e-6), "field 'rms_norm_eps' must be a number above 0"),
    (lambda c: c.update(rms_norm_eps=float("nan")), "'rms_norm_eps' must be a number above 0"),
    (lambda c: c.update(rms_norm_eps="1e-6"), "'rms_norm_eps' must be a number above 0"),
    (rope(rope_theta=0), "field 'rope_theta' must be a number above 0, got 0"),
    (rope(rope_theta=-1e6), "field 'rope_theta' must be a number above 0"),
    (rope(rope_theta="1e6"), "field 'rope_theta' must be a number above 0, got '1e6'"),
    (rope(rope_theta=float("inf")), "field 'rope_theta' must be a number above 0"),
    (lambda c: (c.pop("rope_parameters"), c.update(rope_theta=True)),
     "field 'rope_theta' must be a number above 0, got True"),
    (rope(partial_rotary_factor=0), ("field 'partial_rotary_factor' must be a number above 0 "
     "and at most 1, got 0 (leave it out for the default, 0.25)")),
    (rope(partial_rotary_factor=2), ("field 'partial_rotary_factor' must be a number above 0 "
     "and at most 1, got 2")),
    (rope(partial_rotary_factor=-0.25), "'partial_rotary_factor' must be a number above 0"),
    (rope(partial_rotary_factor=3 / 32), ("fields 'head_dim' (32) and 'partial_rotary_factor' "
     "(0.09375) give a rotary dimension of 3")),
    (rope(partial_rotary_factor=0.01), ("give a rotary dimension of 0; it must be even and at "
     "least 2")),
], ids=["interval-0", "eps-0", "eps-negative", "eps-nan", "eps-a-string", "theta-0",
        "theta-negative", "theta-a-string", "theta-inf", "theta-true", "factor-0", "factor-2",
        "factor-negative", "rotary-odd", "rotary-0"])
def test_rotary_and_norm_values_the_model_cannot_run_are_named(tmp_path, edit, says):
    """(All but the interval and the string eps were taken: NaN logits, a rotary dimension of 0,
    or a traceback from inside the model for a factor of 2.)"""
    assert says in error_of(tmp_path, edit)


@pytest.mark.parametrize(("edit", "says"), [
    (lambda c: c.update(layer_types="full_attention"),
     ("field 'layer_types' must be a list of 'linear_attention' and 'full_attention', one per "
     "layer, got 'full_attention'")),
    (lambda c: c.update(layer_types=[["full_attention"]] * 8), ("field 'layer_types' must be a "
     "list of")),
    (lambda c: c.update(layer_types=[]), ("field 'layer_types' lists 0 layers for "
     "num_hidden_layers 8")),
    (lambda c: c.update(layer_types=["mamba"] * 8), ("field 'layer_types' has unknown type "
     "'mamba'")),
    (lambda c: c.update(tie_word_embeddings="false"),
     "field 'tie_word_embeddings' must be true or false, got 'false'"),
    (lambda c: c.update(num_attention_heads=5), ("field 'num_attention_heads' (5) must be a "
     "multiple of 'num_key_value_heads' (2)")),
    (lambda c: c.update(linear_num_value_heads=3), ("field 'linear_num_value_heads' (3) must be "
     "a multiple of 'linear_num_key_heads' (2)")),
    (lambda c: c.update(head_dim=-32), "field 'head_dim' must be a positive integer, got -32"),
], ids=["types-a-string", "types-of-lists", "types-empty", "types-unknown", "tie-a-string",
        "heads", "linear-heads", "head-dim"])
def test_fields_of_the_wrong_shape_name_the_file_and_field(tmp_path, edit, says):
    """(A string of layer types was counted by its letters, an empty list was replaced by the
    interval's, a string "false" was taken as true, and a heads error did not name the file.)"""
    assert says in error_of(tmp_path, edit)


def moe_config() -> dict:
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(num_hidden_layers=4).to_dict()


@pytest.mark.parametrize(("edit", "says"), [
    (lambda c: c.update(norm_topk_prob="false"),
     "field 'norm_topk_prob' must be true or false, got 'false'"),
    (lambda c: c.update(shared_expert_intermediate_size=-4),
     ("field 'shared_expert_intermediate_size' must be 0 (no shared expert) or a positive "
     "integer, got -4")),
    (lambda c: c.update(shared_expert_intermediate_size="512"),
     ("field 'shared_expert_intermediate_size' must be 0 (no shared expert) or a positive "
     "integer, got '512'")),
    (lambda c: c.update(num_experts_per_tok=9, num_experts=8),
     "field 'num_experts_per_tok' (9) must be at most 'num_experts' (8)"),
], ids=["topk-a-string", "shared-negative", "shared-a-string", "top-k-past-experts"])
def test_moe_fields_of_the_wrong_shape_are_named(tmp_path, edit, says):
    """(A string "false" was taken as true; a negative shared expert width was read as none,
    then its tensors were called unknown.)"""
    cfg = moe_config()
    edit(cfg)
    with pytest.raises(ModelError) as info:
        ModelConfig.from_hf(write(tmp_path, cfg))
    assert str(info.value).startswith(f"{tmp_path / 'config.json'} {says}")


def test_statechat_run_says_a_bad_value_in_one_line(tmp_path, monkeypatch, capsys):
    """`statechat run --model DIR` with a nonsense config.json: one line, before any load."""
    from statechat import cli, cli_setup

    model = shutil.copytree(EMBEDDED_MODEL, tmp_path / "m")
    cfg = embedded()
    cfg["rope_parameters"]["partial_rotary_factor"] = 0
    write(model, cfg)
    monkeypatch.setattr(cli_setup, "load_engine", lambda config: pytest.fail("the model loaded"))
    monkeypatch.setattr("sys.argv", ["statechat", "run", "--model", str(model), "--no-cache"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert err == (f"statechat: {model / 'config.json'} field 'partial_rotary_factor' must be a "
                   "number above 0 and at most 1, got 0 (leave it out for the default, 0.25)")


@pytest.mark.parametrize("edit", [
    no_layer_types(full_attention_interval=None),
    lambda c: c.update(rms_norm_eps=None, linear_conv_kernel_dim=None),
    rope(rope_theta=None, partial_rotary_factor=None),
], ids=["interval", "eps-conv", "rotary"])
def test_a_checkpoint_with_null_fields_loads(tmp_path, edit):
    """(The embedded model's values are the defaults.) Not only from_hf: transformers, which
    picks the tokenizer, refused a null number where it defaults a missing one (and failed on
    a null interval: "cannot load the tokenizer")."""
    import torch

    from statechat.model.loader import load_model

    model = shutil.copytree(EMBEDDED_MODEL, tmp_path / "m")
    cfg = embedded()
    edit(cfg)
    write(model, cfg)
    loaded = load_model(model, dtype=torch.float32)
    assert loaded.config == load_model(EMBEDDED_MODEL, dtype=torch.float32).config


@pytest.mark.parametrize("value", ["missing", None])
def test_a_missing_shared_expert_width_is_transformers_default(tmp_path, value):
    """transformers builds a shared expert of 512 where config.json leaves the width out (or
    null), so such a checkpoint holds its tensors; read as none, they were called unknown.
    An explicit 0 still means no shared expert."""
    from transformers import Qwen3_5MoeTextConfig

    cfg = moe_config()
    if value == "missing":
        cfg.pop("shared_expert_intermediate_size")
    else:
        cfg["shared_expert_intermediate_size"] = value
    theirs = Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.items() if v is not None})
    ours = ModelConfig.from_hf(write(tmp_path, cfg))
    assert ours.shared_expert_intermediate_size == theirs.shared_expert_intermediate_size == 512
    cfg["shared_expert_intermediate_size"] = 0
    assert ModelConfig.from_hf(write(tmp_path, cfg)).shared_expert_intermediate_size == 0
