"""Which graph API each device gets, and an NPU capture that fails leaves its steps eager;
what captures run under: collection paused, on streams no two live owners share.

(The capture itself runs in the GPU tests, through the same device-generic code; no NPU is
available to these tests, so torch_npu is stood in for by a namespace. `torch.device("npu")`
needs torch_npu too: the functions read only `device.type`.)
"""

from __future__ import annotations

import gc
import itertools
import logging
from types import SimpleNamespace

import pytest
import torch

from statechat import devices
from statechat.devices import accelerator, graph_api, no_collection
from statechat.engine.runner import ModelRunner

NPU = SimpleNamespace(type="npu")


class FakeNPUGraph:
    pass


def fake_capture(graph, pool=None, stream=None):
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


class FakeNPU(SimpleNamespace):
    """torch.npu's stream calls, recorded."""

    def current_stream(self, device):
        return "compute stream"

    def set_stream(self, stream):
        self.set_to = stream


def _runner(device) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # no model: only the capture's error path runs
    runner.device = device
    return runner


def _failing_capture(error: Exception):
    def build():
        raise error
    return build


def test_a_failed_npu_capture_warns_restores_the_stream_and_runs_eagerly(monkeypatch, caplog):
    npu = FakeNPU(NPUGraph=FakeNPUGraph, graph=fake_capture, Event=object)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    with caplog.at_level(logging.WARNING, logger="statechat.engine"):
        graphs = _runner(NPU)._capture("prefill", _failing_capture(RuntimeError("not capturable")))
    assert graphs is None  # the runner then runs those steps eagerly
    assert npu.set_to == "compute stream"
    assert "NPU graph capture of the prefill steps failed" in caplog.text
    assert "not capturable" in caplog.text  # the traceback goes with it


def test_only_device_errors_are_taken_for_a_failed_capture(monkeypatch):
    monkeypatch.setattr(torch, "npu", FakeNPU(), raising=False)
    with pytest.raises(TypeError):  # a bug of ours still raises on an NPU
        _runner(NPU)._capture("decode", _failing_capture(TypeError("a bug")))
    with pytest.raises(RuntimeError, match="not capturable"):  # and anything on CUDA
        cuda = _runner(SimpleNamespace(type="cuda"))
        cuda._capture("decode", _failing_capture(RuntimeError("not capturable")))
    assert _runner(NPU)._capture("decode", lambda: "graphs") == "graphs"



def test_no_collection_pauses_collection_and_restores_it():
    """Collection is off inside, and back as it was found after, an exception included."""
    assert gc.isenabled()
    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), no_collection():
        raise ValueError
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


class PooledStream:
    """A stream as torch's pool hands it out: a new object for one of a few handles, in turn."""

    handles = itertools.cycle(range(3))

    def __init__(self, device):
        self.cuda_stream = next(self.handles)


class Owner:
    pass


def test_capture_streams_are_not_shared_while_their_owners_live(monkeypatch):
    monkeypatch.setattr(devices, "accelerator", lambda device: SimpleNamespace(Stream=PooledStream))
    monkeypatch.setattr(PooledStream, "handles", itertools.cycle(range(3)))
    monkeypatch.setattr(devices, "_CAPTURE_STREAMS", {})
    cuda = torch.device("cuda")
    owners = [Owner() for _ in range(4)]
    held = [devices.capture_stream(cuda, owner).cuda_stream for owner in owners[:3]]
    assert sorted(held) == [0, 1, 2]
    assert devices.capture_stream(cuda, owners[3]).cuda_stream in {0, 1, 2}  # all taken: shared
    del owners[held.index(2)]  # its owner goes; the pool's turn is at 1 now
    gc.collect()
    assert devices.capture_stream(cuda, Owner()).cuda_stream == 2  # (1 is taken: skipped)
