"""Every path statechat resolves, in one place: the embedded model, the cache dir, the HF cache."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from statechat.model.config import SUPPORTED_MODEL_TYPES

EMBEDDED_MODEL = Path(__file__).resolve().parent / "assets" / "tiny-qwen3.5"


def is_embedded(model: Path) -> bool:
    """True for the tiny random-weight model shipped inside the package."""
    return Path(model).resolve() == EMBEDDED_MODEL


def cache_dir(explicit: str | Path | None = None) -> Path:
    """--cache-dir, else $STATECHAT_CACHE_DIR, else $XDG_DATA_HOME/statechat (~/.local/share
    where it is unset or relative: the XDG spec takes a relative one as invalid)."""
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get("STATECHAT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    data = os.environ.get("XDG_DATA_HOME", "")
    if not os.path.isabs(data):
        data = Path.home() / ".local" / "share"
    return Path(data) / "statechat"


def hf_hub_cache() -> Path:
    """The hub cache that huggingface_hub (`hf download`) fills: $HF_HUB_CACHE, else
    $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def find_hf_checkpoint() -> Path | None:
    """A Qwen3.5 checkpoint in the local Hugging Face cache (newest snapshot), if any."""
    hub = hf_hub_cache()
    if not hub.is_dir():
        return None
    found = []
    for cfg in hub.glob("models--*/snapshots/*/config.json"):
        try:
            raw = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # (unreadable, not UTF-8, not JSON: another tool's problem)
            continue
        model_type = raw.get("model_type") if isinstance(raw, dict) else None
        if model_type in SUPPORTED_MODEL_TYPES and any(cfg.parent.glob("*.safetensors")):
            found.append(cfg.parent)
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


# a Hugging Face repo id, ORG/NAME (huggingface_hub's characters)
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_repo_id(model: str | Path) -> bool:
    """True for a --model written as a Hugging Face repo id (`Qwen/Qwen3.5-0.8B`)."""
    return REPO_ID.fullmatch(str(model)) is not None


def hub_snapshot(repo_id: str) -> Path | None:
    """The local Hugging Face cache's snapshot of `repo_id` that holds a config.json: the one
    its refs/main names, else the newest; None when the cache has none (nothing is
    downloaded)."""
    repo = hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))
    try:
        main = repo / "snapshots" / (repo / "refs" / "main").read_text(encoding="ascii").strip()
        if (main / "config.json").is_file():
            return main
    except (OSError, ValueError):  # (no refs/main: a snapshot fetched by revision)
        pass
    found = [cfg.parent for cfg in repo.glob("snapshots/*/config.json")]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve_model(model: Path) -> Path:
    """--model as vLLM reads it, offline: a path that exists is the checkpoint directory (what
    is wrong with it, ModelConfig.from_hf says); else a repo id (`Qwen/Qwen3.5-0.8B`) is its
    snapshot in the local Hugging Face cache, when `hf download` put one there. Anything else
    is returned as given (from_hf then says that it does not exist, and how to get it)."""
    if not is_repo_id(model) or model.exists():
        return model
    return hub_snapshot(str(model)) or model


def served_name(model: Path) -> str:
    """The name `serve` gives a checkpoint (/v1/models, every response's `model`): a Hugging
    Face cache snapshot (hub/models--ORG--NAME/snapshots/SHA) its repo id, ORG/NAME, as vLLM
    names what it serves; any other directory its own name."""
    model = Path(os.path.abspath(model))  # (`--model .` inside a snapshot; links kept as given)
    repo = model.parent.parent.name
    if model.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return model.name


def default_model() -> Path:
    """No --model: a Qwen3.5 checkpoint from the HF cache, else the embedded tiny model."""
    return find_hf_checkpoint() or EMBEDDED_MODEL
