"""Checks of the values a config.json gives the text model, for ModelConfig (model/config.py):
each value the model cannot run is a ModelError of one line that names the file and the field
and says what would do. A null optional field means its default, as a missing one does."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from statechat.errors import ModelError

if TYPE_CHECKING:
    from statechat.model.config import ModelConfig

LAYER_TYPES = ("linear_attention", "full_attention")
POSITIVE_INT_FIELDS = frozenset({
    "num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "head_dim", "max_position_embeddings", "linear_conv_kernel_dim", "full_attention_interval",
})


def need(text: dict, cfg_file: Path, key: str, default=None):
    """text[key], checked (a key of POSITIVE_INT_FIELDS must hold a positive integer); `default`
    for a key that may be missing (or null)."""
    if default is not None and text.get(key) is None:
        return default
    if key not in text:
        raise ModelError(f"{cfg_file} lacks the field {key!r}")
    value = text[key]
    if key in POSITIVE_INT_FIELDS and not _is_int(value, least=1):
        raise ModelError(f"{cfg_file} field {key!r} must be a positive integer, got {value!r:.60}")
    return value


def width(text: dict, cfg_file: Path, key: str, default: int) -> int:
    """text[key], a width that may be 0, as of the shared expert (missing or null: `default`)."""
    value = text.get(key)
    value = default if value is None else value
    if not _is_int(value, least=0):
        raise ModelError(f"{cfg_file} field {key!r} must be 0 (no shared expert) or a positive "
                         f"integer, got {value!r:.60}")
    return value


def number(cfg_file: Path, key: str, value, default: float, most: float | None = None) -> float:
    """`value`, a finite number above 0 (and at most `most`); `default` where it is null."""
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or value <= 0 or (most is not None and value > most)):
        bound = "" if most is None else f" and at most {most:g}"
        raise ModelError(f"{cfg_file} field {key!r} must be a number above 0{bound}, got "
                         f"{value!r:.60} (leave it out for the default, {default!r})")
    return float(value)


def flag(cfg_file: Path, key: str, value, default: bool) -> bool:
    """`value`, true or false; `default` where it is null."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelError(f"{cfg_file} field {key!r} must be true or false, got {value!r:.60}")
    return value


def layer_types(text: dict, num_layers: int, cfg_file: Path) -> tuple[str, ...]:
    """Each layer's type: config.json's `layer_types`, else (it missing or null) every
    `full_attention_interval`-th layer full attention (default 4: Qwen3.5's 3:1), the others
    GDN. As in transformers, the interval is not read where layer_types is given."""
    given = text.get("layer_types")
    if given is None:
        interval = need(text, cfg_file, "full_attention_interval", 4)
        return tuple(LAYER_TYPES[(i + 1) % interval == 0] for i in range(num_layers))
    if not isinstance(given, list) or not all(isinstance(t, str) for t in given):
        raise ModelError(f"{cfg_file} field 'layer_types' must be a list of "
                         f"{' and '.join(map(repr, LAYER_TYPES))}, one per layer, got "
                         f"{given!r:.60}")
    return tuple(given)


def check_fields(c: ModelConfig) -> None:
    """A ModelError, its line beginning with "field", for fields that do not fit together (the
    layer types and count, head counts, the rotary dimension, the MLP's widths); from_hf puts
    the file's name before it."""
    if len(c.layer_types) != c.num_hidden_layers:
        raise ModelError(f"field 'layer_types' lists {len(c.layer_types)} layers for "
                         f"num_hidden_layers {c.num_hidden_layers}; give one type per layer")
    bad = [t for t in c.layer_types if t not in LAYER_TYPES]
    if bad:
        raise ModelError(f"field 'layer_types' has unknown type {bad[0]!r:.40}; statechat runs "
                         f"{' and '.join(map(repr, LAYER_TYPES))} layers")
    _multiple(c, "num_attention_heads", "num_key_value_heads")
    _multiple(c, "linear_num_value_heads", "linear_num_key_heads")
    if c.rotary_dim < 2 or c.rotary_dim % 2:
        raise ModelError(f"fields 'head_dim' ({c.head_dim}) and 'partial_rotary_factor' "
                         f"({c.partial_rotary_factor:g}) give a rotary dimension of "
                         f"{c.rotary_dim}; it must be even and at least 2: choose a factor "
                         "that makes head_dim * factor so (Qwen3.5: 256 * 0.25)")
    if c.is_moe:
        k, e = c.num_experts_per_tok, c.num_experts
        if not 0 < k <= e:
            raise ModelError(f"field 'num_experts_per_tok' ({k}) must be at most "
                             f"'num_experts' ({e})")
        if c.moe_intermediate_size <= 0:
            raise ModelError("field 'moe_intermediate_size' must be a positive integer")
    elif c.intermediate_size <= 0:
        raise ModelError("field 'intermediate_size' must be a positive integer for a dense model")


def _multiple(c: ModelConfig, many: str, few: str) -> None:
    a, b = getattr(c, many), getattr(c, few)
    if a % b:
        raise ModelError(f"field {many!r} ({a}) must be a multiple of {few!r} ({b})")


def _is_int(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
