"""What the launchers need to know about the device: its numbers of compute cores (and the
persistent grids sized from them, `persistent_programs` and `persistent_grid`), whether kernels
may be launched as programmatic dependents (`pdl`), which launch options and dot precisions
only NVIDIA's backend takes (`cuda_hints`, `dot_precision`), and how many programs one launch
may hold (`launch`, which every launcher goes through)."""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

# Programs one launch may hold, all grid axes together. Ascend's runtime (CANN) takes at most
# 65,535 per launch; CUDA takes 2^31 - 1 along axis 0 (our launchers keep axes 1 and 2 small).
# Tests lower both to make `launch` split small grids.
MAX_PROGRAMS = 65_535
CUDA_MAX_PROGRAMS = 2**31 - 1


def max_programs(device: torch.device) -> int:
    """The most programs one launch may hold on `device` (CUDA's limit there, CANN's elsewhere:
    the interpreter keeps Ascend's, so tests on the CPU see the limit that binds first)."""
    return CUDA_MAX_PROGRAMS if device.type == "cuda" else MAX_PROGRAMS


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """kernel[grid](*args, PID0=0, **kwargs), or, when the grid holds more programs than the
    device takes in one launch, the same programs in launches along axis 0 one after another,
    each given the axis-0 index of its first program as PID0 (every kernel reads its axis-0
    index as `tl.program_id(0) + PID0`). The split follows the shapes alone: no host sync.
    Pieces are a multiple of 16 programs long where they can be, so that every piece's PID0
    has the same specialisation (one compiled kernel)."""
    # the common case first and cheaply: this runs before every launch of an eager step
    first = args[0]
    device = (first if isinstance(first, torch.Tensor)
              else next(a for a in args if isinstance(a, torch.Tensor))).device
    cap = CUDA_MAX_PROGRAMS if device.type == "cuda" else MAX_PROGRAMS
    if math.prod(grid) <= cap:
        kernel[grid](*args, PID0=0, **kwargs)
        return
    rest = math.prod(grid[1:])
    if rest > cap:
        raise ValueError(f"a grid {tuple(grid)} has more than {cap} programs beyond its axis 0")
    step = cap // rest
    step -= step % 16 if step >= 16 else 0
    for start in range(0, grid[0], step):
        kernel[(min(step, grid[0] - start), *grid[1:])](*args, PID0=start, **kwargs)


@functools.lru_cache(maxsize=8)
def _properties(device: torch.device) -> dict:
    """The active Triton driver's properties of `device` ({} for the interpreter and drivers
    that have none)."""
    try:
        return dict(triton.runtime.driver.active.utils.get_device_properties(device.index or 0))
    except Exception:  # noqa: BLE001 - the interpreter and unknown drivers have no properties
        return {}


@functools.lru_cache(maxsize=8)
def num_cores(device: torch.device) -> int:
    """Cores that run vector work: streaming multiprocessors (CUDA), the vector cores of an
    Ascend NPU (triton-ascend's `num_vectorcore`; a kernel without `tl.dot` runs its programs
    there), a guess of 8 elsewhere (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    props = _properties(device)
    counts = [
        props[k] for k in ("num_vectorcore", "multiprocessor_count", "num_aicore")
        if props.get(k, 0) > 0  # (a count of 0 names no core: the next key, else the guess)
    ]
    return int(counts[0]) if counts else 8


def num_cube_cores(device: torch.device) -> int:
    """Cores that run kernels with `tl.dot`: the SMs on CUDA (num_cores); on an Ascend NPU its
    AI cores (triton-ascend's `num_aicore`: a kernel mixing matrix and vector work runs one
    program per AI core, each a cube unit with its vector units, and there are half as many as
    vector cores on a 910B); num_cores where the driver names no such count."""
    props = {} if device.type == "cuda" else _properties(device)
    return int(props["num_aicore"]) if props.get("num_aicore", 0) > 0 else num_cores(device)


# Programs per core of the kernels that loop on every device (the row kernels: norms, rope,
# silu_mul, slots, conv1d's decode and window kernels; and attention, whose loop ran faster on
# the H100 than one program per item), by device type: each launches min(work items, that x
# cores) programs, program p taking items p, p + P, p + 2P, ... (module-level so that a
# benchmark can sweep it).
# CUDA: 32 (H100, bench_grid's shapes: 16 and 8 ran up to 5% slower at 32,768 tokens, 4 up to
# 2x; fewer programs leave too few resident to hide the memory latency). Elsewhere one per core,
# as triton-ascend's guides advise (each program beyond the cores is another round there).
ROW_PROGRAMS_PER_CORE = {"cuda": 32, "other": 1}


def persistent_programs(items: int, device: torch.device, dots: bool = False,
                        per_core: int | None = None) -> int:
    """The grid of a persistent kernel over `items` work items on `device`: one program per item
    up to `per_core` programs per core (ROW_PROGRAMS_PER_CORE's for the device unless given),
    then that many, each looping over the items `range(pid, items, programs)`. `dots`: the
    kernel uses `tl.dot`, so its cores are `num_cube_cores` (fewer on an NPU), else
    `num_cores`."""
    if per_core is None:
        per_core = ROW_PROGRAMS_PER_CORE["cuda" if device.type == "cuda" else "other"]
    cores = num_cube_cores(device) if dots else num_cores(device)
    return max(1, min(items, per_core * cores))


# Programs per core of the kernels that also have a loop-free form (a `LOOP` constexpr: GDN,
# the conv prefill, the sampler, moe; attention always loops, on ROW_PROGRAMS_PER_CORE), by
# device type; None: one program per item. CUDA: None.
# Looping, even once, took these kernels 14-33% longer on the H100 (chunk_gdn at 8,192 tokens
# 406 -> 487 us, the conv prefill 103 -> 138, GDN decode at 32 sequences 21.4 -> 24.3,
# sample_top_k at 32 rows 141 -> 178; docs/bench.md, session 37), and CUDA's block scheduler
# needs no persistent grid. Elsewhere one per core, looping, as on Ascend.
ITEM_PROGRAMS_PER_CORE: dict[str, int | None] = {"cuda": None, "other": 1}


def persistent_grid(items: int, device: torch.device, dots: bool = False) -> tuple[int, bool]:
    """(programs, loop) of a kernel with a loop-free form over `items` work items: programs as
    `persistent_programs` gives them under ITEM_PROGRAMS_PER_CORE (one per item where that is
    None), and whether they must loop (the kernel's `LOOP` constexpr): unless there is exactly
    one program per item, program p takes items p, p + P, ... (no item: one program, no trip)."""
    per_core = ITEM_PROGRAMS_PER_CORE["cuda" if device.type == "cuda" else "other"]
    if per_core is None:
        programs = max(1, items)
    else:
        programs = persistent_programs(items, device, dots, per_core)
    return programs, programs != items


def cuda_hints(device: torch.device, **hints) -> dict:
    """Launch options tuned for NVIDIA GPUs (num_warps, num_stages): `hints` on CUDA devices,
    none elsewhere, so that another backend (triton-ascend, which takes neither) keeps its own
    defaults. Every launch passes such options through here (tests/kernels/test_portability)."""
    return hints if device.type == "cuda" else {}


def dot_precision(device: torch.device, dtype: torch.dtype) -> str:
    """tl.dot's input_precision for operands of `dtype` on `device`: "ieee" for float32 (TF32
    would miss the tests' tolerances), NVIDIA's "tf32" for the rest on CUDA (16-bit operands
    multiply exactly either way; it only matters to the float32 operands a kernel mixes in),
    and "ieee" on every other device, where TF32 may not exist."""
    if dtype == torch.float32 or device.type != "cuda":
        return "ieee"
    return "tf32"


@functools.lru_cache(maxsize=8)
def _pdl_ok(device: torch.device) -> bool:
    if (device.type != "cuda" or torch.version.cuda is None
            or os.environ.get("STATECHAT_PDL") == "0"):
        return False
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl(device: torch.device) -> dict:
    """Launch arguments for programmatic dependent launch (CUDA, compute capability 9 and up;
    STATECHAT_PDL=0 turns it off): a kernel so launched may start while the kernel before it
    finishes, and must call `gdc_enter` before it reads or writes anything that kernel may
    touch. Decode steps are chains of small kernels, so each one's start overlaps the tail of
    the one before (the one-row linears load their weights meanwhile). Elsewhere: no-op."""
    return {"USE_GDC": True, "launch_pdl": True} if _pdl_ok(device) else {"USE_GDC": False}


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr):
    """Wait until the kernel before has finished and its writes are visible, then let the next
    kernel launch. Waiting first keeps at most one kernel waiting ahead of the running one."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
