"""Every kernel launched with programmatic dependent launch waits for the previous kernel before anything else.

A kernel launched with PDL may start while the kernel before it still runs; if it touched memory before
`early_start(PDL)` it would race with that kernel, on Hopper GPUs only and only now and then. So the rule of
kernels/dependent_launch.py is checked on the source: each `kernel[grid](..., **early_launch(device))` in
fasterllm/kernels launches a @triton.jit function whose first statement (after its docstring) is `early_start(PDL)`.
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


def _starts_early(function: ast.FunctionDef) -> bool:
    body = function.body[1:] if ast.get_docstring(function) is not None else function.body
    first = body[0]
    return (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
            and isinstance(first.value.func, ast.Name) and first.value.func.id == "early_start"
            and [ast.unparse(a) for a in first.value.args] == ["PDL"])


def test_every_kernel_launched_early_waits_first():
    checked, wrong = [], []
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
        for name in sorted(_early_launches(tree)):
            checked.append(f"{path.name}:{name}")
            if name not in functions or not _starts_early(functions[name]):
                wrong.append(f"{path.name}:{name}")
    assert not wrong, f"launched with PDL but not starting with early_start(PDL): {wrong}"
    assert len(checked) >= 20, f"only {checked} found: the check no longer sees the launches"
