"""The context length the generate and embedding engines allow (prompt checks: input_processor.py)."""
from __future__ import annotations


def resolve_max_model_len(requested: int | None, default: int, limit: int, limit_name: str) -> int:
    """max_model_len as asked (default when not asked); more than the model's limit positions is an error that
    names the limit as limit_name ("max_position_embeddings=8192", "512 positions")."""
    if requested is None:
        return default
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's {limit_name}; use max_model_len <= {limit}")
    return requested

