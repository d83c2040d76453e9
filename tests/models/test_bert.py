"""Our packed BERT-family encoder against transformers on the same weights, and packed vs padded attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fasterllm.layers.varlen_attention import VarlenBatch, varlen_attention
from fasterllm.loader.hf_checkpoint import iter_safetensors
from fasterllm.loader.model_source import default_embedding_model_path
from fasterllm.models.bert import BertConfig, BertModel

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def minilm():
    """(our LLM, transformers AutoModel) on the embedded all-MiniLM-L6-v2, fp32."""
    from fasterllm import LLM

    path = default_embedding_model_path()
    ours = LLM(task="embed", dtype="float32", device="cpu")
    reference = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return ours, reference


def _reference_embeddings(model, token_ids: list[list[int]]) -> torch.Tensor:
    """sentence-transformers' computation: one padded batch, masked mean pooling, L2 normalisation."""
    max_len = max(len(ids) for ids in token_ids)
    input_ids = torch.tensor([ids + [0] * (max_len - len(ids)) for ids in token_ids])
    mask = torch.tensor([[1] * len(ids) + [0] * (max_len - len(ids)) for ids in token_ids])
    with torch.inference_mode():
        hidden = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    summed = (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
    return F.normalize(summed, dim=-1)


def test_minilm_matches_transformers_on_a_mixed_length_batch(minilm):
    ours, reference = minilm
    tokenizer = ours.get_tokenizer()
    words = "the quick brown fox jumps over a lazy dog while it rains in paris".split()
    texts = ["Hi", "A", "The seed of Job's tears.", " ".join(words * 3), " ".join(words * 9)]
    max_len = ours.engine.max_model_len
    assert max_len == 256  # sentence_bert_config.json's max_seq_length
    inputs: list = texts + [[101] + tokenizer.encode("rain", add_special_tokens=False) * (max_len - 2) + [102]]
    outputs = ours.embed(inputs, use_tqdm=False)
    lengths = [len(o.prompt_token_ids) for o in outputs]
    assert min(lengths) == 3 and max(lengths) == max_len
    assert [o.prompt_token_ids for o in outputs[:-1]] == [tokenizer.encode(t) for t in texts]
    ours_vectors = torch.tensor([o.outputs.embedding for o in outputs])
    expected = _reference_embeddings(reference, [o.prompt_token_ids for o in outputs])
    cosine = F.cosine_similarity(ours_vectors, expected)
    assert cosine.min() >= 0.9999, cosine
    assert torch.allclose(ours_vectors.norm(dim=-1), torch.ones(len(inputs)), atol=1e-5)


def test_embedding_does_not_depend_on_the_rest_of_the_batch(minilm):
    ours, _ = minilm
    alone = ours.embed("A cat sat on the mat.", use_tqdm=False)[0].outputs.embedding
    batch = ["short", "A cat sat on the mat.", "another sentence of a different length, longer than the others"]
    together = ours.embed(batch, use_tqdm=False)[1].outputs.embedding
    assert torch.allclose(torch.tensor(alone), torch.tensor(together), atol=1e-6)


def test_packed_attention_matches_padded_masked_attention():
    torch.manual_seed(0)
    heads, head_dim, lengths = 4, 8, [1, 7, 7, 3, 16, 16, 2]
    batch = VarlenBatch.from_lengths(lengths, torch.device("cpu"))
    assert [(r.num_seqs, r.seq_len) for r in batch.runs] == [(1, 1), (2, 7), (1, 3), (2, 16), (1, 2)]
    qkv = torch.randn(sum(lengths), 3 * heads * head_dim)
    packed = varlen_attention(qkv, batch, heads)
    # the padded computation it replaces: [batch, max_len] with padded keys masked out
    max_len = max(lengths)
    padded = torch.zeros(len(lengths), max_len, 3, heads, head_dim)
    mask = torch.zeros(len(lengths), 1, 1, max_len, dtype=torch.bool)
    starts = batch.cu_seqlens.tolist()
    for i, length in enumerate(lengths):
        padded[i, :length] = qkv[starts[i]:starts[i] + length].view(length, 3, heads, head_dim)
        mask[i, ..., :length] = True
    q, k, v = padded.permute(2, 0, 3, 1, 4)
    attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)
    expected = torch.cat([attended[i, :length] for i, length in enumerate(lengths)])
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("packed_weights", [False, True], ids=["torch", "onednn"])
def test_tiny_random_encoder_matches_transformers(tmp_path, kind, packed_weights):
    """Hidden states of every real token; RoBERTa checks the position offset (padding_idx + 1)."""
    torch.manual_seed(1)
    shape = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=40, hidden_act="gelu_new" if kind == "roberta" else "gelu")
    if kind == "bert":
        reference = transformers.BertModel(transformers.BertConfig(**shape), add_pooling_layer=True)
    else:
        reference = transformers.RobertaModel(transformers.RobertaConfig(pad_token_id=1, **shape))
    reference.eval().save_pretrained(tmp_path)
    config = BertConfig.from_hf(reference.config.to_dict())
    assert config.max_seq_len == (40 if kind == "bert" else 38)
    ours = BertModel(config)
    ours.load_weights(iter_safetensors(tmp_path))
    if packed_weights:
        ours.pack_for_cpu()
    sequences = [torch.randint(3, 97, (n,)).tolist() for n in (5, 1, 12, config.max_seq_len, 5)]
    lengths = [len(s) for s in sequences]
    batch = VarlenBatch.from_lengths(lengths, torch.device("cpu"))
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.inference_mode():
        hidden = ours(torch.tensor(sum(sequences, [])), positions, batch)
        for seq, start in zip(sequences, batch.cu_seqlens.tolist()):
            expected = reference(torch.tensor([seq])).last_hidden_state[0]
            torch.testing.assert_close(hidden[start:start + len(seq)], expected, atol=1e-4, rtol=1e-4)


def test_unsupported_encoder_configs_are_named():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="model_type 'llama' is not a supported encoder"):
        BertConfig.from_hf({**base, "model_type": "llama"})
    with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
        BertConfig.from_hf({**base, "model_type": "bert", "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        BertConfig.from_hf({**base, "model_type": "bert", "hidden_act": "relu"})
