"""The embedded tiny model, loaded once for every app test."""

from __future__ import annotations

import pytest
import torch

from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL


@pytest.fixture(scope="session")
def loaded():
    return load_model(EMBEDDED_MODEL, dtype=torch.float32)
