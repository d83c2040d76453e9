"""Every kernel launched with programmatic dependent launch waits for the previous kernel before it touches memory.

A kernel launched with PDL may start while the kernel before it still runs; if it touched memory before
`early_start(PDL)` it would race with that kernel, on Hopper GPUs only and only now and then. So the rule of
kernels/dependent_launch.py is checked on the source: each `kernel[grid](..., **early_launch(device))` in
fasterllm/kernels launches a function in which no statement before `early_start(PDL)` (gluon_parts.py's in a
Gluon kernel) loads, stores or calls a helper that does, except `load_weight_chunk`: a layer's weights, which no
kernel writes while decode steps run (the first chunk of gemv.py's float weights, the first step's of
int4_gemv.py's and int8_gemv.py's).
"""
from __future__ import annotations

import ast
from pathlib import Path

import fasterllm.kernels

KERNELS = Path(fasterllm.kernels.__file__).parent


def _early_launches(tree: ast.Module) -> set[str]:
    """Names of the kernels this module launches with early_launch's keywords (or a launch_pdl keyword)."""
    def early(keyword: ast.keyword) -> bool:
        value = keyword.value
        called = value.func if isinstance(value, ast.Call) else None
        return keyword.arg == "launch_pdl" or (keyword.arg is None and isinstance(called, ast.Name)
                                                and called.id == "early_launch")

    return {node.func.value.id for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name) and any(early(k) for k in node.keywords)}


MEMORY_OPS = {"load", "store", "atomic_add", "atomic_cas", "atomic_xchg", "atomic_max", "atomic_min"}
WEIGHT_LOADS = "load_weight_chunk"


def _is_early_start(statement: ast.stmt) -> bool:
    call = statement.value if isinstance(statement, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id == "early_start" and [ast.unparse(a) for a in call.args] == ["PDL"])


def _touches_memory(node: ast.AST, functions: dict[str, ast.FunctionDef], seen: set[str]) -> bool:
    """Whether node loads or stores, itself or through a helper of the module (WEIGHT_LOADS excepted)."""
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
        if name in MEMORY_OPS:
            return True
        if name in functions and name != WEIGHT_LOADS and name not in seen:
            seen.add(name)
            if _touches_memory(functions[name], functions, seen):
                return True
    return False


def _starts_early(function: ast.FunctionDef, functions: dict[str, ast.FunctionDef]) -> bool:
    body = function.body[1:] if ast.get_docstring(function) is not None else function.body
    for statement in body:
        if _is_early_start(statement):
            return True
        if _touches_memory(statement, functions, set()):
            return False
    return False


def test_every_kernel_launched_early_waits_first():
    checked, wrong = [], []
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
        for name in sorted(_early_launches(tree)):
            checked.append(f"{path.name}:{name}")
            if name not in functions or not _starts_early(functions[name], functions):
                wrong.append(f"{path.name}:{name}")
    assert not wrong, f"launched with PDL but touching memory before early_start(PDL): {wrong}"
    assert len(checked) >= 20, f"only {checked} found: the check no longer sees the launches"
