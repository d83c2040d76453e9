"""Load our kernel modules as they were at an earlier commit, next to today's, so one benchmark run times both.

The old files come from `git show COMMIT:PATH`, or from a folder holding them (the GPU machine may get the working
tree without .git: extract them first with `python3 benchmarks/kernel_baseline.py COMMIT FOLDER MODULE...`). They
are written into a throwaway package whose imports of each other point inside it (Triton reads a kernel's source
from its file, so they must be real files) and imported from there.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

_PACKAGE = "fasterllm.kernels."


def old_source(source: str, module: str) -> str:
    """The text of fasterllm/kernels/MODULE.py at a commit, or MODULE.py from a folder."""
    folder = Path(source)
    if folder.is_dir():
        return (folder / f"{module}.py").read_text()
    return subprocess.run(["git", "show", f"{source}:fasterllm/kernels/{module}.py"], check=True, text=True,
                          capture_output=True).stdout


def load_baseline(source: str, modules: list[str], package: str = "kernels_baseline") -> dict[str, ModuleType]:
    """Import fasterllm.kernels.<module> for each of modules as they were at source (commit or folder)."""
    root = Path(tempfile.mkdtemp(prefix="kernel_baseline_"))
    (root / package).mkdir()
    (root / package / "__init__.py").write_text("")
    for module in modules:
        text = old_source(source, module)
        for other in modules:  # the old modules use each other, not today's
            text = text.replace(f"{_PACKAGE}{other} ", f"{package}.{other} ")
        (root / package / f"{module}.py").write_text(text)
    sys.path.insert(0, str(root))
    return {module: importlib.import_module(f"{package}.{module}") for module in modules}


if __name__ == "__main__":
    commit, folder, *names = sys.argv[1:]
    Path(folder).mkdir(parents=True, exist_ok=True)
    for name in names:
        (Path(folder) / f"{name}.py").write_text(old_source(commit, name))
