"""Outputs across the engine process boundary: the server side rebuilds exactly the cumulative outputs the engine
made, while each step sends only what changed."""
from __future__ import annotations

import pickle

from fasterllm.engine.output_deltas import OutputDecoder, OutputEncoder
from fasterllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def output(step: int, finished: bool = False, order=(0, 1)) -> RequestOutput:
    """A request with two samples; sample 1 stops at step 3, sample 0 runs on; finishing reorders them (best_of)."""
    completions = []
    for index in order:
        length = min(step, 3) if index == 1 else step
        completions.append(CompletionOutput(
            index, "ab" * length, list(range(length)), -0.5 * length,
            [{t: Logprob(-0.5, 1, "ab")} for t in range(length)],
            finish_reason="stop" if index == 1 and step >= 3 else ("length" if finished else None)))
    return RequestOutput("r", "prompt", [7] * 500, completions, finished, RequestMetrics(1.0))


def test_decoded_outputs_equal_the_engines_and_deltas_stay_small():
    encoder, decoder = OutputEncoder(), OutputDecoder()
    sizes = []
    for step in range(1, 8):
        sent = output(step, finished=step == 7, order=(1, 0) if step == 7 else (0, 1))
        message = pickle.dumps(encoder.encode([("r", sent)]))
        sizes.append(len(message))
        (request_id, got), = decoder.decode(pickle.loads(message))
        assert request_id == "r" and got == sent
    # the first and the finished output go whole (the 500 prompt ids); the steps between carry one token each
    assert max(sizes[1:6]) < sizes[0] / 4 and sizes[6] > sizes[0] / 2


def test_errors_pass_and_forgotten_requests_drop_their_deltas():
    encoder, decoder = OutputEncoder(), OutputDecoder()
    decoder.decode(encoder.encode([("r", output(1))]))
    decoder.forget("r")  # aborted on the server side while a delta was on its way
    assert decoder.decode(encoder.encode([("r", output(2))])) == []
    error = RuntimeError("step failed")
    assert decoder.decode(encoder.encode([("r", error)])) == [("r", error)]
    (_, restarted), = decoder.decode(encoder.encode([("r", output(1))]))  # the id used again: sent whole
    assert restarted == output(1)
