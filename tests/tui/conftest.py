"""The embedded tiny model, loaded once for every app test; a long reply that leaves the app idle
between its tokens (rest_between_steps)."""

from __future__ import annotations

import time

import pytest
import torch

from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL


@pytest.fixture(scope="session")
def loaded():
    return load_model(EMBEDDED_MODEL, dtype=torch.float32)


STEP_REST_S = 0.05  # after each engine step of a long reply (see rest_between_steps)


def rest_between_steps(app) -> None:
    """The app's engine (loaded) rests STEP_REST_S after each step, as it waits on a GPU: the
    app is idle between tokens. Textual's pilot waits, after each key and pause, until the
    process is idle or a second has passed; the tiny model streaming on the CPU without rest
    made every key of a test during a long reply cost two seconds. The reply still streams
    (tokens arrive, the handle is live) until it ends or is stopped."""
    worker = app.worker
    step = worker._step

    def resting_step() -> None:
        step()
        time.sleep(STEP_REST_S)

    worker._step = resting_step  # (this app's worker alone: it ends with the app)
