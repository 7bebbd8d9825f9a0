"""Fixtures of the CLI tests: the embedded tiny model loaded once per module, and the commands'
engines made on it (no load per command)."""

from __future__ import annotations

import pytest
import torch

from statechat import cli_setup
from statechat.engine.engine import LLMEngine
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL


@pytest.fixture(scope="module")
def loaded():
    return load_model(EMBEDDED_MODEL, dtype=torch.float32)


@pytest.fixture
def shared_engine(loaded, monkeypatch):
    monkeypatch.setattr(cli_setup, "load_engine", lambda config: LLMEngine(config, loaded=loaded))
