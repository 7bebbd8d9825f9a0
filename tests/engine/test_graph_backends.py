"""Which graph API each device gets, and an NPU capture that fails leaves the engine eager.

(The capture itself runs in the GPU tests, through the same device-generic code; no NPU is
available to these tests, so torch_npu is stood in for by a namespace. `torch.device("npu")`
needs torch_npu too: the functions read only `device.type`.)
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from statechat.devices import accelerator, graph_api
from statechat.engine.runner import ModelRunner

NPU = SimpleNamespace(type="npu")


class FakeNPUGraph:
    pass


def fake_capture(graph, pool=None):
    raise AssertionError("not called here")


def test_cuda_gets_torch_cuda_graphs_and_the_cpu_none():
    assert graph_api(torch.device("cuda")) == (torch.cuda.CUDAGraph, torch.cuda.graph)
    assert accelerator(torch.device("cuda")) is torch.cuda
    assert graph_api(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="not an accelerator"):
        accelerator(torch.device("cpu"))


def test_npu_gets_torch_npu_graphs_when_torch_npu_has_them(monkeypatch):
    npu = SimpleNamespace(NPUGraph=FakeNPUGraph, graph=fake_capture, Event=object)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    assert graph_api(NPU) == (FakeNPUGraph, fake_capture)
    assert accelerator(NPU) is npu


def test_npu_without_graph_capture_runs_eagerly(monkeypatch):
    monkeypatch.setattr(torch, "npu", SimpleNamespace(Event=object), raising=False)
    assert graph_api(NPU) is None
    monkeypatch.delattr(torch, "npu")
    assert graph_api(NPU) is None


def _runner_whose_capture_fails(device) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # no model: only the capture's error path runs
    runner.device, runner.graphs, runner.prefill_graphs = device, None, None

    def fail(*args):
        runner.graphs = "half-captured"
        raise RuntimeError("capture not supported for this kernel")

    runner._capture_graphs = fail
    return runner


def test_a_failed_npu_capture_warns_and_leaves_every_step_eager(caplog):
    runner = _runner_whose_capture_fails(NPU)
    with caplog.at_level(logging.WARNING, logger="statechat.engine"):
        runner.capture_graphs(8, 4, 256)
    assert runner.graphs is None and runner.prefill_graphs is None
    assert "NPU graph capture failed (RuntimeError: capture not supported" in caplog.text


def test_a_failed_cuda_capture_raises():
    runner = _runner_whose_capture_fails(SimpleNamespace(type="cuda"))
    with pytest.raises(RuntimeError, match="capture not supported"):
        runner.capture_graphs(8, 4, 256)
