"""A --device statechat cannot use is one line that says what to pass instead."""

from __future__ import annotations

import pytest

from statechat.config import EngineConfig
from statechat.errors import ConfigError


@pytest.mark.parametrize(("device", "says"), [
    ("cuda:1", ("device 'cuda:1': statechat runs on one device of a kind; pass --device cuda "
                "and pick that one with CUDA_VISIBLE_DEVICES=1")),
    ("npu:0", ("device 'npu:0': statechat runs on one device of a kind; pass --device npu and "
               "pick that one with ASCEND_RT_VISIBLE_DEVICES=0")),
    ("mps", "unknown device 'mps'; choose one of auto, cpu, cuda, npu"),
    ("cpu:x", "unknown device 'cpu:x'; choose one of auto, cpu, cuda, npu"),
])
def test_a_device_statechat_cannot_use_says_what_to_pass(device, says):
    with pytest.raises(ConfigError) as info:
        EngineConfig(model="m", device=device)
    assert str(info.value) == says
