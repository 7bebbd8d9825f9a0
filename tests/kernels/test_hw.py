"""The core counts that size persistent grids follow the device's own kind of core.

On an Ascend NPU triton-ascend reports two counts: `num_vectorcore` (where a kernel of vector
work alone runs its programs) and `num_aicore` (where a kernel with `tl.dot` runs them; half as
many on a 910B). A persistent grid sized from the wrong one runs a dot kernel in two rounds,
or vector kernels on half the cores. Here the driver's properties are faked as an NPU's.
"""

from __future__ import annotations

import pytest
import torch

from kernels import hw

NPU = torch.device("meta", 0)  # a device that is not CUDA: the properties decide


@pytest.fixture
def npu_properties(monkeypatch):
    def fake(props):
        monkeypatch.setattr(hw, "_properties", lambda device: props)
        hw.num_cores.cache_clear()
    yield fake
    hw.num_cores.cache_clear()


def test_vector_and_dot_kernels_take_their_own_cores_on_an_npu(npu_properties):
    npu_properties({"num_aicore": 24, "num_vectorcore": 48, "max_shared_mem": 1 << 20})
    assert hw.num_cores(NPU) == 48
    assert hw.num_cube_cores(NPU) == 24
    assert hw.persistent_programs(10_000, NPU) == 48  # one program per core off CUDA
    assert hw.persistent_programs(10_000, NPU, dots=True) == 24
    assert hw.persistent_programs(5, NPU, dots=True) == 5  # never more programs than items
    # kernels with a loop-free form: it runs where every item has its own program
    assert hw.persistent_grid(10_000, NPU, dots=True) == (24, True)
    assert hw.persistent_grid(10_000, NPU) == (48, True)
    assert hw.persistent_grid(24, NPU, dots=True) == (24, False)
    assert hw.persistent_grid(0, NPU) == (1, True)  # no item: one program, no trip


def test_a_driver_without_the_npu_counts_falls_back(npu_properties):
    npu_properties({"multiprocessor_count": 6})
    assert hw.num_cores(NPU) == hw.num_cube_cores(NPU) == 6
    npu_properties({"num_aicore": 0, "num_vectorcore": 0, "multiprocessor_count": 6})
    assert hw.num_cores(NPU) == hw.num_cube_cores(NPU) == 6  # a count of 0 names no core
    npu_properties({})
    assert hw.num_cores(NPU) == hw.num_cube_cores(NPU) == 8
    assert hw.persistent_programs(0, NPU) == 1
