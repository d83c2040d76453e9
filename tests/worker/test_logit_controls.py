"""Each logit control against a direct implementation of its definition, on fixed logits."""
import pytest
import torch

from fasterllm.engine.request import Request
from fasterllm.sampling_params import SamplingParams
from fasterllm.worker.logit_controls import LogitControls
from fasterllm.worker.request_states import RequestStates
from fasterllm.worker.step_messages import SchedulerOutput

VOCAB = 10
LOGITS = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.5, 0.0, 3.0, -2.0, 1.0, -3.0]])
EOS = 9
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def request(prompt, output, **params):
    """The worker's state of a request with these tokens, as the engine's message describes it."""
    r = Request("r", None, list(prompt), SamplingParams(max_tokens=50, **params), [EOS], 1024)
    for token in output:
        r.append_token(token)
    worker = RequestStates(torch.device("cpu"))
    worker.update(SchedulerOutput(new_requests=[r.new_request_data()]))
    return worker.states["r"]


def controlled(req, device):
    controls = LogitControls.build([req], VOCAB, device)
    return controls.apply(LOGITS.to(device))[0].cpu()


def test_repetition_penalty_is_transformers_definition_over_prompt_and_output(device):
    req = request(prompt=[0, 1], output=[1, 6], repetition_penalty=2.0)
    expected = LOGITS[0].clone()
    for token in {0, 1, 6}:  # prompt tokens count too
        expected[token] = expected[token] / 2 if expected[token] > 0 else expected[token] * 2
    assert torch.equal(controlled(req, device), expected)


def test_presence_and_frequency_count_generated_tokens_only(device):
    req = request(prompt=[0, 4, 4], output=[6, 6, 6, 2], presence_penalty=0.5, frequency_penalty=0.25)
    expected = LOGITS[0].clone()
    for token, count in {6: 3, 2: 1}.items():  # 0 and 4 appear only in the prompt: untouched
        expected[token] -= 0.5 + 0.25 * count
    assert torch.allclose(controlled(req, device), expected)


def test_negative_presence_penalty_encourages_repeats(device):
    req = request(prompt=[], output=[7], presence_penalty=-2.0)
    assert controlled(req, device)[7] == LOGITS[0, 7] + 2.0


def test_logit_bias_is_added(device):
    req = request(prompt=[0], output=[], logit_bias={7: 100.0, 6: -100.0})
    out = controlled(req, device)
    assert out[7] == LOGITS[0, 7] + 100 and out[6] == LOGITS[0, 6] - 100 and out.argmax() == 7


def test_min_tokens_bans_eos_and_stop_ids_until_reached(device):
    params = dict(min_tokens=3, stop_token_ids=[4])
    early = controlled(device=device, req=request(prompt=[0], output=[1, 2], **params))
    assert early[EOS] == float("-inf") and early[4] == float("-inf")
    assert torch.equal(early[:4], LOGITS[0, :4])
    late = controlled(device=device, req=request(prompt=[0], output=[1, 2, 3], **params))
    assert torch.equal(late, LOGITS[0])


def test_bad_words_ban_single_tokens_always_and_longer_words_only_as_their_last_token(device):
    req = request(prompt=[0], output=[5, 2], bad_words=["(set below as ids)"])
    req.bad_word_ids = [[6], [2, 8], [1, 3]]
    out = controlled(req, device)
    assert out[6] == float("-inf")  # single-token word
    assert out[8] == float("-inf")  # output ends with 2: 8 would complete [2, 8]
    assert out[3] == LOGITS[0, 3]  # output does not end with 1


def test_allowed_token_ids_leave_only_those(device):
    out = controlled(device=device, req=request(prompt=[0], output=[], allowed_token_ids=[1, 3]))
    assert torch.isfinite(out).nonzero().flatten().tolist() == [1, 3]


def test_rows_without_controls_are_untouched_in_a_mixed_batch(device):
    plain, penalized = request([0], [6]), request([0], [6], frequency_penalty=1.0)
    controls = LogitControls.build([plain, penalized], VOCAB, device)
    out = controls.apply(LOGITS.repeat(2, 1).to(device)).cpu()
    assert torch.equal(out[0], LOGITS[0]) and out[1, 6] == LOGITS[0, 6] - 1.0
    assert LogitControls.build([plain], VOCAB, device) is None


@pytest.mark.parametrize("kwargs, field", [
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"logit_bias": {1: 101}}, r"logit_bias\[1\]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias key"), ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"bad_words": [" "]}, "bad_words"), ({"allowed_token_ids": []}, "allowed_token_ids"),
])
def test_invalid_controls_name_the_parameter(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
