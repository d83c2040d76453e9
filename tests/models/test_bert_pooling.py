"""Pooling of packed sequences, and reading the pooling a sentence-transformers directory asks for."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from fasterllm.layers.pooling import PoolingConfig, pool
from fasterllm.loader.encoder_checkpoint import read_pooling


@pytest.mark.parametrize("mode", ["mean", "cls", "max", "mean_sqrt_len", "last"])
@pytest.mark.parametrize("normalize", [False, True])
def test_pool_matches_per_sequence_computation(mode, normalize):
    torch.manual_seed(0)
    lengths = [3, 1, 5]
    hidden = torch.randn(sum(lengths), 6)
    cu_seqlens = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    per_sequence = {
        "mean": lambda h: h.mean(0), "cls": lambda h: h[0], "max": lambda h: h.max(0).values,
        "mean_sqrt_len": lambda h: h.sum(0) / len(h) ** 0.5, "last": lambda h: h[-1]}[mode]
    expected = torch.stack([per_sequence(h) for h in hidden.split(lengths)])
    if normalize:
        expected = F.normalize(expected, dim=-1)
    torch.testing.assert_close(pool(hidden, cu_seqlens, PoolingConfig(mode, normalize)), expected)


def _write_st_dir(path, pooling: dict | None, normalize: bool):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))


def test_read_pooling_follows_sentence_transformers_modules(tmp_path):
    assert read_pooling(tmp_path) == PoolingConfig("cls", True)  # no modules.json: vLLM's BERT default
    cls_dir, mean_dir, named_dir, bad_dir = (tmp_path / n for n in ("cls", "mean", "named", "bad"))
    for d in (cls_dir, mean_dir, named_dir, bad_dir):
        d.mkdir()
    _write_st_dir(cls_dir, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, normalize=False)
    assert read_pooling(cls_dir) == PoolingConfig("cls", False)
    _write_st_dir(mean_dir, {"pooling_mode_mean_tokens": True}, normalize=True)
    assert read_pooling(mean_dir) == PoolingConfig("mean", True)
    _write_st_dir(named_dir, {"pooling_mode": "lasttoken"}, normalize=True)
    assert read_pooling(named_dir) == PoolingConfig("last", True)
    _write_st_dir(bad_dir, {"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True}, normalize=False)
    with pytest.raises(ValueError, match=r"asks for pooling modes \['cls', 'max'\]"):
        read_pooling(bad_dir)
