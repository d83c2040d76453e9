"""Checks the generate and embedding engines share: the context length they allow and prompt token ids."""
from __future__ import annotations


def resolve_max_model_len(requested: int | None, default: int, limit: int, limit_name: str) -> int:
    """max_model_len as asked (default when not asked); more than the model's limit positions is an error that
    names the limit as limit_name ("max_position_embeddings=8192", "512 positions")."""
    if requested is None:
        return default
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's {limit_name}; use max_model_len <= {limit}")
    return requested


def check_token_ids(token_ids: list, vocab_size: int, what: str) -> None:
    """Every id an int (not a bool) in the vocabulary; the error shows the first bad ones, named as `what`."""
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} {bad[:5]} are not valid: ids must be integers in [0, {vocab_size})")
