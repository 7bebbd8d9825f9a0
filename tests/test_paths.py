"""Where statechat looks without being told: the default model is found wherever `hf download`
put it, as huggingface_hub resolves its cache (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME, ~)."""

from __future__ import annotations

import json

import pytest

from statechat.paths import EMBEDDED_MODEL, default_model


def _snapshot(hub):
    """A Qwen3.5 snapshot in a hub cache, as `hf download` lays it out."""
    snap = hub / "models--Qwen--Qwen3.5-0.8B" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    (snap / "model.safetensors").write_bytes(b"")
    return snap


@pytest.mark.parametrize("variable, value, hub", [
    ("HF_HUB_CACHE", "hub", "hub"),
    ("HF_HOME", "home", "home/hub"),
    ("XDG_CACHE_HOME", "xdg", "xdg/huggingface/hub"),
])
def test_the_default_model_is_found_where_huggingface_hub_keeps_it(tmp_path, monkeypatch,
                                                                    variable, value, hub):
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "nobody"))
    assert default_model() == EMBEDDED_MODEL
    snap = _snapshot(tmp_path / hub)
    monkeypatch.setenv(variable, str(tmp_path / value))
    assert default_model() == snap
