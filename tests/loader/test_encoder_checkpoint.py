"""Which embedding path a checkpoint takes (loader/encoder_checkpoint.py): decoder or encoder, and a decoder's pooling."""
from __future__ import annotations

import json

from fasterllm.layers.pooling import PoolingConfig
from fasterllm.loader.encoder_checkpoint import DECODER_POOLING, decoder_pooling, is_decoder
from fasterllm.loader.model_source import ModelSource, default_model_path, resolve_model


def _directory(tmp_path, architecture: str, pooling_flags: dict | None = None) -> ModelSource:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    if pooling_flags is not None:
        (tmp_path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_flags))
    return resolve_model(str(tmp_path), task="embed")


def test_gguf_files_and_causal_lm_directories_are_decoders(tmp_path):
    assert is_decoder(resolve_model(str(default_model_path()), task="embed"))
    assert is_decoder(_directory(tmp_path, "Qwen2ForCausalLM"))
    assert not is_decoder(resolve_model(None, task="embed"))  # the embedded all-MiniLM-L6-v2 (BertModel)


def test_decoder_pooling_is_the_normalised_last_token_unless_the_modules_say_otherwise(tmp_path):
    assert decoder_pooling(resolve_model(str(default_model_path()))) == DECODER_POOLING
    assert DECODER_POOLING == PoolingConfig("last", normalize=True)
    (tmp_path / "plain").mkdir()
    assert decoder_pooling(_directory(tmp_path / "plain", "LlamaForCausalLM")) == DECODER_POOLING
    (tmp_path / "st").mkdir()
    with_modules = _directory(tmp_path / "st", "LlamaForCausalLM", {"pooling_mode_mean_tokens": True})
    assert decoder_pooling(with_modules) == PoolingConfig("mean", normalize=False)  # no Normalize module follows
