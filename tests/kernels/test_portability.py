"""The Triton sources in kernels/ keep the rules of DESIGN.md's "## Kernels" that can be read
off the code (one source for CUDA and Ascend), checked on the source alone, nothing run:

- no launcher reads a device value on the host: no `.item()`, `.tolist()`, `.cpu()`,
  `.numpy()` or `synchronize()` in a function that launches a kernel (`launch(kernel, ...)`),
  itself or through the module's functions it calls (a public op whose launches sit in
  helpers), nor in any function of its module that such a function calls, directly or not;
- no pointer moves across loop iterations: in a loop of a `@triton.jit` function, no `p += d`,
  `p -= d` or `p = p + d` on a pointer (a name used, directly or through other names and
  helper calls, as the address of a tl.load or tl.store, or whose `.dtype.element_ty` is read);
  offsets are computed from the loop index instead;
- every launch goes through `kernels.hw.launch` (which keeps a launch within the device's
  program limit, CANN's 65,535 on Ascend, by splitting it along axis 0), and every kernel reads
  its axis-0 index as `tl.program_id(0) + PID0`, never `tl.num_programs(0)`, so that a split
  launch computes what one launch would;
- CUDA-only hints sit behind a guard: no launch names num_warps, num_stages, num_ctas, maxnreg
  or launch_pdl as its own keyword (they come through `kernels.hw.cuda_hints` and
  `kernels.hw.pdl`, which give none off CUDA, or a dict chosen by device), `tl.extra.cuda`
  appears only inside an `if` (a constexpr branch), and the string "tf32" only in
  kernels/hw.py (`dot_precision`, TF32 on CUDA alone).

- kernels run on persistent grids: every kernel's axis-0 index starts a `range(start, items,
  programs)` loop over its work items, or is the item of the loop-free form of a kernel that
  has both (the `else` of `if LOOP:`, one program per item), but the few in NOT_PERSISTENT,
  each with its reason; no kernel reads a grid axis beyond 0 but in that loop-free form, and
  no jit function returns early or loops with `while`.

Each check also runs on small deliberately broken sources, so a check that stopped finding
anything fails here rather than passing silently. What it does not prove: int64 offsets,
grids sized from the core count (the launchers' `persistent_programs`; tests/kernels/
test_persistent.py and each op's own test check the grids) and masks over `tl.where` need
judgement (docs/kernels.md, Ascend section).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
MODULES = sorted(p for p in KERNELS.glob("*.py") if p.name != "reference.py")
HOST_READS = frozenset({"item", "tolist", "cpu", "numpy", "synchronize"})
CUDA_LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl"})
TF32 = frozenset({"tf32", "tf32x3"})


def _is_jit(fn: ast.FunctionDef) -> bool:
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _launched(call: ast.Call) -> str | None:
    """The kernel a call launches: `launch(kernel, grid, ...)` or `kernel[grid](...)`."""
    if isinstance(call.func, ast.Name) and call.func.id == "launch" and call.args:
        first = call.args[0]
        return first.id if isinstance(first, ast.Name) else None
    if isinstance(call.func, ast.Subscript) and isinstance(call.func.value, ast.Name):
        return call.func.value.id
    return None


def _launches(fn: ast.FunctionDef, kernels: set[str]) -> list[ast.Call]:
    """The launches of a kernel of this module in fn."""
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and _launched(n) in kernels]


def _callees(fn: ast.FunctionDef, names: set[str]) -> set[str]:
    """The functions of `names` that fn calls by name."""
    return {n.func.id for n in ast.walk(fn)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in names}


def _launchers(funcs: dict[str, ast.FunctionDef], kernels: set[str]) -> set[str]:
    """Functions that launch a kernel of the module, themselves or through helpers they call
    (a public op that checks, lays out and launches in separate functions)."""
    hosts = set(funcs) - kernels
    calls = {name: _callees(funcs[name], hosts) for name in hosts}
    found = {name for name in hosts if _launches(funcs[name], kernels)}
    grown = True
    while grown:
        before = len(found)
        found |= {name for name in hosts if calls[name] & found}
        grown = len(found) > before
    return found


def host_reads(tree: ast.Module) -> list[str]:
    """`.item()` and the like in the launchers and every module function they reach."""
    funcs = _functions(tree)
    kernels = {name for name, fn in funcs.items() if _is_jit(fn)}
    todo = sorted(_launchers(funcs, kernels))
    seen, found = set(todo), []
    while todo:
        fn = funcs[todo.pop()]
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Attribute) and node.func.attr in HOST_READS:
                found.append(f"{fn.name}:{node.lineno}: .{node.func.attr}()")
            name = node.func.id if isinstance(node.func, ast.Name) else None
            if name in funcs and name not in kernels and name not in seen:
                seen.add(name)
                todo.append(name)
    return sorted(found)


def _base(node: ast.expr) -> str | None:
    """The name an address expression starts from: p in `p + o`, `p[:, None] + 1 + o`."""
    while True:
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            node = node.left
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            return node.id if isinstance(node, ast.Name) else None


def _pointers(fn: ast.FunctionDef, params_of: dict[str, set[int]]) -> set[str]:
    """Names that hold pointers in jit function fn (params_of: pointer parameter positions of
    the module's jit functions, as known so far)."""
    ptrs: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("load", "store") and node.args:
                ptrs.add(_base(node.args[0]))
            if isinstance(func, ast.Name) and func.id in params_of:
                ptrs.update(_base(node.args[i]) for i in params_of[func.id] if i < len(node.args))
        elif (isinstance(node, ast.Attribute) and node.attr == "element_ty"
              and isinstance(node.value, ast.Attribute) and node.value.attr == "dtype"):
            ptrs.add(_base(node.value.value))
    assigns = [(t.id, n.value) for n in ast.walk(fn) if isinstance(n, ast.Assign)
               for t in n.targets if isinstance(t, ast.Name)]
    grown = True
    while grown:  # p_x = x + offsets: x holds a pointer too
        before = len(ptrs)
        ptrs.update(_base(value) for name, value in assigns if name in ptrs)
        grown = len(ptrs) > before
    ptrs.discard(None)
    return ptrs


def _jit_pointers(tree: ast.Module) -> dict[str, set[str]]:
    """Pointer names of each jit function, their pointer parameters followed across calls."""
    jits = {name: fn for name, fn in _functions(tree).items() if _is_jit(fn)}
    params_of: dict[str, set[int]] = {name: set() for name in jits}
    changed = True
    while changed:
        changed = False
        for name, fn in jits.items():
            ptrs = _pointers(fn, params_of)
            positions = {i for i, a in enumerate(fn.args.args) if a.arg in ptrs}
            if positions != params_of[name]:
                params_of[name], changed = positions, True
    return {name: _pointers(fn, params_of) for name, fn in jits.items()}


def _steps(loop: ast.For | ast.While, ptrs: set[str]) -> list[ast.stmt]:
    """`p += d`, `p -= d` and `p = p + d` on pointers p inside loop."""
    found = []
    for node in ast.walk(loop):
        if isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Add, ast.Sub)):
            target, moved = node.target, True
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            moved = isinstance(target, ast.Name) and _base(node.value) == target.id
        else:
            continue
        if moved and isinstance(target, ast.Name) and target.id in ptrs:
            found.append(node)
    return found


def pointer_steps(tree: ast.Module) -> list[str]:
    """Pointers moved inside a loop of a jit function."""
    functions, found = _functions(tree), []
    for name, ptrs in _jit_pointers(tree).items():
        for loop in ast.walk(functions[name]):
            if isinstance(loop, (ast.For, ast.While)):
                found += [f"{name}:{s.lineno}: pointer moved in a loop" for s in _steps(loop, ptrs)]
    return sorted(set(found))


def _is_program_id_0(node: ast.AST, attr: str) -> bool:
    """`tl.<attr>(0)`, the axis given by place or as `axis=0`."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == attr):
        return False
    axes = node.args + [k.value for k in node.keywords if k.arg == "axis"]
    return len(axes) == 1 and isinstance(axes[0], ast.Constant) and axes[0].value == 0


def uncapped_launches(tree: ast.Module, is_hw: bool) -> list[str]:
    """Launches around `kernels.hw.launch`, kernels it launches without a PID0 parameter, and
    axis-0 indices read without PID0 (or as tl.num_programs(0), a split launch's piece)."""
    found = []
    funcs = _functions(tree)
    kernels = {name for name, fn in funcs.items() if _is_jit(fn)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and not is_hw:
            found.append(f"{node.lineno}: kernel[grid](...) outside kernels.hw.launch")
        kernel = _launched(node) if isinstance(node, ast.Call) else None
        if (kernel in kernels and isinstance(node.func, ast.Name)
                and "PID0" not in [a.arg for a in funcs[kernel].args.args]):
            found.append(f"{node.lineno}: {kernel} launched without a PID0 parameter")
    for name in sorted(kernels):
        offset = set()  # the program_id(0) calls that `+ PID0` follows
        for node in ast.walk(funcs[name]):
            if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
                    and isinstance(node.right, ast.Name) and node.right.id == "PID0"):
                offset.add(id(node.left))
        for node in ast.walk(funcs[name]):
            if _is_program_id_0(node, "program_id") and id(node) not in offset:
                found.append(f"{name}:{node.lineno}: tl.program_id(0) without + PID0")
            if _is_program_id_0(node, "num_programs"):
                found.append(f"{name}:{node.lineno}: tl.num_programs(0)")
    return found


# kernels left with one program per work item, and why (docs/kernels.md, "Persistent grids")
NOT_PERSISTENT = {
    # walks its column tiles from its program id, the first tile's load issued before the loop
    # (it streams while the kernel before finishes); at most 4 programs per core
    "_gemv_kernel",
    # one program per row of a one-row linear's argmax (at most gemv.GEMV_MAX_ROWS rows)
    "_argmax_kernel",
}


def _is_range(node: ast.AST) -> bool:
    return (isinstance(node, ast.For) and isinstance(node.iter, ast.Call)
            and isinstance(node.iter.func, ast.Name) and node.iter.func.id == "range"
            and len(node.iter.args) == 3)


def _is_loop_choice(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "LOOP"


def not_persistent(tree: ast.Module) -> list[str]:
    """Kernels off a persistent grid: an axis-0 index (`tl.program_id(0) + PID0`) that neither
    starts a `range(start, items, programs)` loop nor sits in the loop-free form of a kernel
    that has both (the `else` of `if LOOP:`), a grid axis beyond 0, and, in any jit function,
    an early `return` or a `while` loop (which Ascend's guides advise against)."""
    found = []
    for name, fn in _functions(tree).items():
        if not _is_jit(fn):
            continue
        starts = {id(n.iter.args[0]) for n in ast.walk(fn) if _is_range(n)}
        # the loop-free form: the `else` of an `if LOOP:` (one program per item, on the grid
        # axes the kernel's items have)
        loop_free = {id(n) for branch in ast.walk(fn) if _is_loop_choice(branch)
                     for stmt in branch.orelse for n in ast.walk(stmt)}
        starts |= loop_free
        for node in ast.walk(fn):
            if isinstance(node, ast.Return) and node.value is None:
                found.append(f"{name}:{node.lineno}: return")
            if isinstance(node, ast.While):
                found.append(f"{name}:{node.lineno}: while")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "program_id"
                    and not _is_program_id_0(node, "program_id") and id(node) not in loop_free):
                found.append(f"{name}:{node.lineno}: tl.program_id beyond axis 0")
            if (name not in NOT_PERSISTENT and isinstance(node, ast.BinOp)
                    and isinstance(node.right, ast.Name) and node.right.id == "PID0"
                    and id(node) not in starts):
                found.append(f"{name}:{node.lineno}: program index outside a loop's start")
    return found


def unguarded_cuda_hints(tree: ast.Module, is_hw: bool) -> list[str]:
    """Launch options, tl.extra.cuda and "tf32" outside their guards."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            found += [f"{node.lineno}: launch keyword {kw.arg}=" for kw in node.keywords
                      if kw.arg in CUDA_LAUNCH_OPTIONS]
        if isinstance(node, ast.Constant) and node.value in TF32 and not is_hw:
            found.append(f"{node.lineno}: {node.value!r} outside kernels/hw.py")
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and _is_jit(n)):
        found += [f"{fn.name}:{n.lineno}: tl.extra.cuda outside an if"
                  for n in _unguarded_nodes(fn, False) if _is_extra_cuda(n)]
    return found


def _is_extra_cuda(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "cuda"
            and isinstance(node.value, ast.Attribute) and node.value.attr == "extra")


def _unguarded_nodes(node: ast.AST, guarded: bool):
    """Nodes under node that no `if` statement encloses (its test included: only its body)."""
    for child in ast.iter_child_nodes(node):
        inside = guarded or (isinstance(node, ast.If) and child is not node.test)
        if not inside:
            yield child
        yield from _unguarded_nodes(child, inside)


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_launchers_read_no_device_value_on_the_host(path):
    assert host_reads(_parse(path)) == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_pointer_moves_across_loop_iterations(path):
    assert pointer_steps(_parse(path)) == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_every_launch_goes_through_the_program_cap(path):
    assert uncapped_launches(_parse(path), path.name == "hw.py") == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_kernels_loop_over_their_items_on_one_grid_axis(path):
    assert not_persistent(_parse(path)) == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_cuda_only_hints_are_behind_a_guard(path):
    assert unguarded_cuda_hints(_parse(path), path.name == "hw.py") == []


BROKEN_LAUNCHER = '''
@triton.jit
def _k(x, n, BLOCK: tl.constexpr):
    tl.store(x + tl.arange(0, BLOCK), 0.0)
def _count(t):
    return int(t.sum().item())
def op(x):
    _k[(1,)](x, _count(x), BLOCK=16, num_warps=4)
@triton.jit
def _j(x, PID0, BLOCK: tl.constexpr):
    tl.store(x + (tl.program_id(0) + PID0) + tl.num_programs(0), 0.0)
    tl.store(x + tl.program_id(0), 1.0)
    tl.store(x + tl.program_id(axis=0), 2.0)
def op2(x):
    launch(_j, (1,), x, BLOCK=16)
    launch(_k, (1,), x, 0, BLOCK=16)
def _check(x):
    return x.tolist()
def op3(x):
    _check(x)
    op2(x)
'''

BROKEN_LOOP = '''
@triton.jit
def _row(p, o):
    return tl.load(p + o)
@triton.jit
def _k(x, y, n, BLOCK: tl.constexpr):
    p_y = y + tl.arange(0, BLOCK)
    for _ in range(n):
        b = _row(x, tl.arange(0, BLOCK))
        x += BLOCK
        tl.store(p_y, b.to(y.dtype.element_ty))
        p_y = p_y + BLOCK
    b_acc = tl.zeros([BLOCK], tl.float32)
    for _ in range(n):
        b_acc += 1.0
    if n > 0:
        tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    tl.dot(b_acc, b_acc, input_precision="tf32")
'''

BROKEN_GRID = '''
@triton.jit
def _p(x, N, NUM_PROGS, PID0, BLOCK: tl.constexpr):
    for i_item in range(tl.program_id(0) + PID0, N, NUM_PROGS):
        tl.store(x + i_item, 0.0)
    i_h = tl.program_id(1)
    if i_h > 0:
        return
    while N > 0:
        N -= 1
@triton.jit
def _q(x, PID0, LOOP: tl.constexpr):
    if LOOP:
        tl.store(x + tl.program_id(0) + PID0, 1.0)
    else:
        tl.store(x + tl.program_id(0) + PID0 + tl.program_id(1), 2.0)
'''


def test_each_check_finds_what_it_is_for():
    """The broken sources above hold each violation once: every one is reported (the host read
    of a check that op3 runs before launching through op2 included), the harmless accumulator
    loop and the guarded tl.extra.cuda are not."""
    launcher, loop = ast.parse(BROKEN_LAUNCHER), ast.parse(BROKEN_LOOP)
    assert host_reads(launcher) == ["_check:18: .tolist()", "_count:6: .item()"]
    assert uncapped_launches(launcher, False) == [
        "8: kernel[grid](...) outside kernels.hw.launch",
        "16: _k launched without a PID0 parameter",
        "_j:11: tl.num_programs(0)", "_j:12: tl.program_id(0) without + PID0",
        "_j:13: tl.program_id(0) without + PID0"]
    assert pointer_steps(loop) == ["_k:10: pointer moved in a loop",
                                   "_k:12: pointer moved in a loop"]
    assert unguarded_cuda_hints(launcher, False) == ["8: launch keyword num_warps="]
    assert unguarded_cuda_hints(loop, False) == ["19: 'tf32' outside kernels/hw.py",
                                                 "_k:18: tl.extra.cuda outside an if"]
    assert unguarded_cuda_hints(loop, True) == ["_k:18: tl.extra.cuda outside an if"]
    assert sorted(not_persistent(ast.parse(BROKEN_GRID))) == [
        "_p:6: tl.program_id beyond axis 0", "_p:8: return", "_p:9: while",
        "_q:14: program index outside a loop's start"]
