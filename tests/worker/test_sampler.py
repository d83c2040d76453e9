import torch

from fasterllm.sampling_params import SamplingParams
from fasterllm.worker.sampler import SamplingMetadata, filtered_probs, sample

VOCAB = 8
LOGITS = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0]])


def metadata(params, generators=None):
    return SamplingMetadata.build(params, generators or [None] * len(params), VOCAB, torch.device("cpu"))


def test_top_k_keeps_exactly_k_tokens_renormalised():
    probs = filtered_probs(LOGITS, metadata([SamplingParams(top_k=3)]))[0]
    expected = torch.zeros(VOCAB)
    expected[:3] = LOGITS[0, :3].softmax(-1)
    assert torch.allclose(probs, expected, atol=1e-6)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    full = LOGITS[0].softmax(-1)  # 0.61, 0.22, 0.08, ...
    top_p = (full[0] + full[1]).item() - 1e-3  # needs the first two tokens
    probs = filtered_probs(LOGITS, metadata([SamplingParams(top_p=top_p)]))[0]
    expected = torch.zeros(VOCAB)
    expected[:2] = full[:2] / full[:2].sum()
    assert torch.allclose(probs, expected, atol=1e-6)
    only_first = filtered_probs(LOGITS, metadata([SamplingParams(top_p=0.5)]))[0]
    assert only_first[0] == 1.0 and only_first[1:].sum() == 0


def test_min_p_drops_tokens_below_fraction_of_the_best():
    full = LOGITS[0].softmax(-1)
    min_p = 0.1  # keeps tokens with p >= 0.1 * p_max
    probs = filtered_probs(LOGITS, metadata([SamplingParams(min_p=min_p)]))[0]
    keep = full >= min_p * full.max()
    expected = torch.where(keep, full, torch.zeros_like(full))
    assert torch.allclose(probs, expected / expected.sum(), atol=1e-6)
    assert keep.sum() == 3


def test_temperature_then_filters_per_row():
    rows = LOGITS.repeat(3, 1)
    md = metadata([SamplingParams(temperature=0.5), SamplingParams(temperature=2.0, top_k=2),
                   SamplingParams(temperature=1.0)])
    probs = filtered_probs(rows, md)
    assert torch.allclose(probs[0], (LOGITS[0] / 0.5).softmax(-1), atol=1e-6)
    expected = torch.zeros(VOCAB)
    expected[:2] = (LOGITS[0, :2] / 2.0).softmax(-1)
    assert torch.allclose(probs[1], expected, atol=1e-6)
    assert torch.allclose(probs[2], LOGITS[0].softmax(-1), atol=1e-6)


def test_sampling_frequencies_follow_the_filtered_distribution():
    torch.manual_seed(0)
    params = SamplingParams(temperature=1.0, top_k=3)
    rows = LOGITS.repeat(20000, 1)
    tokens = sample(rows, metadata([params] * rows.shape[0])).token_ids
    counts = torch.bincount(tokens, minlength=VOCAB).float() / rows.shape[0]
    expected = torch.zeros(VOCAB)
    expected[:3] = LOGITS[0, :3].softmax(-1)
    assert torch.allclose(counts, expected, atol=0.015)
    assert counts[3:].sum() == 0


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    rows = torch.randn(4, VOCAB)
    md = metadata([SamplingParams(temperature=0), SamplingParams(temperature=1.0),
                   SamplingParams(temperature=0), SamplingParams(temperature=0.8)])
    tokens = sample(rows, md).token_ids
    assert tokens[0] == rows[0].argmax() and tokens[2] == rows[2].argmax()


def test_seeded_row_is_independent_of_the_rest_of_the_batch():
    params = SamplingParams(temperature=1.0, seed=1234)
    rows = torch.randn(1, VOCAB).repeat(5, 1)

    def draw(batch_rows, seeded_row):
        generator = torch.Generator().manual_seed(1234)
        gens = [generator if i == seeded_row else None for i in range(batch_rows)]
        params_list = [params if i == seeded_row else SamplingParams(temperature=1.0) for i in range(batch_rows)]
        md = metadata(params_list, gens)
        return [sample(rows[:batch_rows], md).token_ids[seeded_row].item() for _ in range(30)]

    alone = draw(1, 0)
    assert draw(5, 3) == alone
    assert len(set(alone)) > 1  # it is really sampling


def test_logprobs_report_sampled_token_first_with_rank():
    md = metadata([SamplingParams(temperature=0, logprobs=2)])
    out = sample(LOGITS, md)
    reference = LOGITS[0].log_softmax(-1)
    assert out.logprob_token_ids[0].tolist() == [0, 0, 1]
    assert torch.allclose(out.logprobs[0], reference[[0, 0, 1]])
    assert out.sampled_ranks[0].item() == 1
