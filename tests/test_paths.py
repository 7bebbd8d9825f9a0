"""Where statechat looks without being told: the default model is found wherever `hf download`
put it, as huggingface_hub resolves its cache (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME, ~), and
so is a model named by its repo id; the default cache dir ignores a relative $XDG_DATA_HOME."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from statechat.config import EngineConfig
from statechat.errors import ModelError
from statechat.model.config import ModelConfig
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


def test_a_repo_id_as_the_model_is_its_snapshot_in_the_hf_cache(tmp_path, monkeypatch):
    """`--model Qwen/Qwen3.5-0.8B`, as vLLM takes it, loads what `hf download` put in the cache
    (the snapshot refs/main names); a folder of that name in the working one wins."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    old = _snapshot(tmp_path / "hub")
    new = old.parent / "def456"
    shutil.copytree(old, new)
    (old.parent.parent / "refs").mkdir()
    (old.parent.parent / "refs" / "main").write_text("abc123")
    assert EngineConfig(model="Qwen/Qwen3.5-0.8B").model == old
    assert EngineConfig(model="Qwen/Qwen3.5-2B").model == Path("Qwen/Qwen3.5-2B")
    (tmp_path / "Qwen" / "Qwen3.5-0.8B").mkdir(parents=True)
    assert EngineConfig(model="Qwen/Qwen3.5-0.8B").model == Path("Qwen/Qwen3.5-0.8B")


def test_a_repo_id_not_in_the_cache_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError) as info:
        ModelConfig.from_hf(EngineConfig(model="Qwen/Qwen3.5-0.8B").model)
    assert str(info.value) == (
        f"model directory Qwen/Qwen3.5-0.8B does not exist, nor is Qwen/Qwen3.5-0.8B in the "
        f"Hugging Face cache ({tmp_path / 'hub'}); statechat does not download models: run "
        "`hf download Qwen/Qwen3.5-0.8B` first, or pass --model DIR with a checkpoint directory")
    with pytest.raises(ModelError, match="^model directory models/x/y does not exist$"):
        ModelConfig.from_hf(EngineConfig(model="models/x/y").model)


def test_a_relative_xdg_data_home_is_ignored(tmp_path, monkeypatch):
    """A relative $XDG_DATA_HOME is invalid (the XDG spec: ignore it), so the default cache dir
    is ~/.local/share/statechat from every working directory; it was under the working
    directory, so each folder a user started in got a cache (and chats) of its own."""
    from statechat.paths import cache_dir

    monkeypatch.delenv("STATECHAT_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_DATA_HOME", "data")
    assert cache_dir() == tmp_path / ".local" / "share" / "statechat"
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert cache_dir() == tmp_path / "data" / "statechat"
