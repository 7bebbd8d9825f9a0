"""A multimodal checkpoint's config.json (model_type qwen3_5, the text model under text_config)
gives its end-of-sequence ids at the top level when neither text_config nor
generation_config.json has any: they were ignored, and the model then had no EOS id at all
(replies ran to max_tokens). text_config's own, and generation_config.json's, still win."""

from __future__ import annotations

import json
import shutil

import pytest

from statechat.model.config import ModelConfig
from statechat.paths import EMBEDDED_MODEL


def multimodal(tmp_path, top=None, text=None, gen=None) -> ModelConfig:
    """The tiny checkpoint's config nested as a multimodal one's, with these eos_token_ids."""
    shutil.copy(EMBEDDED_MODEL / "config.json", tmp_path / "config.json")
    text_config = json.loads((tmp_path / "config.json").read_text())
    text_config.pop("eos_token_id", None)
    raw = {"model_type": "qwen3_5", "text_config": {**text_config, "eos_token_id": text},
           "vision_config": {}, "eos_token_id": top}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {} if gen is None else {"eos_token_id": gen}))
    return ModelConfig.from_hf(tmp_path)


@pytest.mark.parametrize("top, text, gen, ids", [
    (248044, None, None, (248044,)),  # (the top level's: it was ())
    ([5, 6], None, None, (5, 6)),
    (248044, 7, None, (7,)),  # text_config's wins
    (248044, 7, [8, 9], (8, 9)),  # generation_config.json's wins
    (None, None, None, ()),
])
def test_the_top_level_eos_ids_are_the_fallback(tmp_path, top, text, gen, ids):
    assert multimodal(tmp_path, top, text, gen).eos_token_ids == ids
