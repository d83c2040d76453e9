"""Text decoded in the server's process (an engine in a process of its own sends token ids, as deltas) equals the text
the engine makes itself, output by output: eos at the end (decoded or not), special tokens kept, characters split over
tokens, and the requests whose text the engine keeps (stop strings, several samples)."""
from __future__ import annotations

import pytest

from fasterllm import SamplingParams
from fasterllm.config import EngineArgs
from fasterllm.engine.engine import Engine
from fasterllm.engine.output_deltas import OutputEncoder
from fasterllm.engine.server_side_text import ServerSideText
from fasterllm.outputs import CompletionOutput, RequestMetrics, RequestOutput


@pytest.fixture(scope="module")
def engines():
    args = dict(dtype="float32", device="cpu", cpu_kv_cache_gib=0.25, max_model_len=512)
    return Engine(EngineArgs(**args)), Engine(EngineArgs(**args), text_elsewhere=True)


def test_text_decoded_on_the_server_side_equals_the_engines_own(engines):
    whole, elsewhere = engines
    chat = whole.tokenizer.encode_chat([{"role": "user", "content": "Say hello."}], True)
    requests = {
        "eos, special tokens kept": (chat, SamplingParams(temperature=0, max_tokens=48,
                                                     skip_special_tokens=False)),
        "eos": (chat, SamplingParams(temperature=0, max_tokens=48)),
        "emoji": ("Three emoji in a row: 🙂", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        "stop string": ("The capital of France is", SamplingParams(temperature=0, max_tokens=16, stop=[" is"])),
        "two samples": ("Once upon a time", SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8)),
    }
    eos = whole.eos_token_ids[0]
    forced = dict(temperature=0, max_tokens=4, logit_bias={eos: 100.0}, skip_special_tokens=False)
    requests.update({  # eos forced under ignore_eos: decoded, also where it ends the request as a stop token id
        "eos ignored": ("Hi", SamplingParams(**forced, ignore_eos=True)),
        "eos as a stop token id": ("Hi", SamplingParams(**forced, ignore_eos=True, stop_token_ids=[eos])),
    })
    encoder, server_side = OutputEncoder(), ServerSideText(elsewhere.tokenizer, elsewhere.eos_token_ids)
    for request_id, (prompt, params) in requests.items():
        whole.add_request(request_id, prompt, params)
        elsewhere.add_request(request_id, prompt, params)
        server_side.expect(request_id, params)
    ends = {}
    while whole.has_unfinished_requests():
        expected = whole.step()
        got = server_side.outputs(encoder.encode([(output.request_id, output) for output in elsewhere.step()]))
        assert ([(request_id, o.outputs, o.finished) for request_id, o in got]
                == [(o.request_id, o.outputs, o.finished) for o in expected])
        ends.update({o.request_id: o.outputs[0] for o in expected if o.finished})
    assert not elsewhere.has_unfinished_requests()
    assert not (server_side._params or server_side._decoding or server_side._deltas._last)  # nothing left behind
    # the cases happened: an eos ended the chat replies (not decoded, even where special tokens are kept)
    assert ends["eos"].finish_reason == ends["eos, special tokens kept"].finish_reason == "stop"
    assert ends["eos, special tokens kept"].text == ends["eos"].text != ""
    assert ends["stop string"].stop_reason == " is"
    assert ends["eos ignored"].token_ids == [eos] * 4 and ends["eos ignored"].text != ""
    stopped = ends["eos as a stop token id"]
    assert stopped.token_ids == [eos] and stopped.stop_reason == eos and stopped.text != ""


def test_outputs_of_an_aborted_request_on_their_way_are_dropped_not_kept():
    """An abort sent while a turn with the request's first output was on its way: that output is dropped (the decoder
    would otherwise keep it for good), and the id may be added again afresh."""
    completion = CompletionOutput(0, "ab", [1, 2], None, None)
    first = RequestOutput("r", "p", [5], [completion], False, RequestMetrics(1.0))
    server_side = ServerSideText(tokenizer=None, eos_token_ids=[])
    params = SamplingParams(max_tokens=8, stop=["x"])  # the engine keeps this one's text: no tokenizer here
    server_side.expect("r", params)
    server_side.forget("r")  # aborted
    encoded = OutputEncoder().encode([("r", first)])
    assert server_side.outputs(encoded) == [] and not server_side._deltas._last
    server_side.expect("r", params)  # the id added again: its outputs pass
    assert server_side.outputs(encoded) == [("r", first)]
    assert server_side.outputs(OutputEncoder().encode([("never added", first)])) == []
