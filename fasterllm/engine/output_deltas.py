"""RequestOutputs across a process boundary, without resending what the other side has.

A RequestOutput is cumulative: every step's carries the whole text, token ids and logprobs so far. Sent whole each
step, a request's bytes would grow with the square of its length. The engine side (OutputEncoder) sends a request's
first output and its finished one whole, and in between only what each completion gained; the server side
(OutputDecoder) rebuilds the cumulative outputs. An error that failed a request passes as it is.
"""
from __future__ import annotations

from collections.abc import Container
from dataclasses import replace

from fasterllm.outputs import CompletionOutput, RequestOutput

_WHOLE, _DELTA, _ERROR = 0, 1, 2


class OutputEncoder:
    def __init__(self) -> None:
        self._sent: dict[str, list[tuple[int, int, int]]] = {}  # per completion: (chars, tokens, logprobs) sent

    def encode(self, outputs: list[tuple[str, RequestOutput | Exception]]) -> list[tuple]:
        encoded = []
        for request_id, output in outputs:
            if isinstance(output, Exception):
                self._sent.pop(request_id, None)
                encoded.append((_ERROR, request_id, output))
                continue
            sent = self._sent.get(request_id)
            if output.finished:
                self._sent.pop(request_id, None)
            else:
                self._sent[request_id] = [(len(c.text), len(c.token_ids), len(c.logprobs or ())) for c in output.outputs]
            if sent is None or output.finished or len(sent) != len(output.outputs):
                encoded.append((_WHOLE, request_id, output))
                continue
            encoded.append((_DELTA, request_id, [
                (c.text[chars:], c.token_ids[tokens:], None if c.logprobs is None else c.logprobs[logprobs:],
                 c.cumulative_logprob, c.finish_reason, c.stop_reason)
                for c, (chars, tokens, logprobs) in zip(output.outputs, sent)]))
        return encoded

    def forget(self, request_id: str) -> None:
        """The request was aborted: a later request under its id starts afresh."""
        self._sent.pop(request_id, None)


class OutputDecoder:
    def __init__(self) -> None:
        self._last: dict[str, RequestOutput] = {}

    def decode(self, encoded: list[tuple], live: Container[str] | None = None
               ) -> list[tuple[str, RequestOutput | Exception]]:
        """The outputs; a delta of a request this side has forgotten (aborted meanwhile) is dropped, and so is any
        output of a request not in live, where given (the requests added and not ended)."""
        outputs = []
        for kind, request_id, body in encoded:
            if live is not None and request_id not in live:
                continue
            if kind == _DELTA:
                last = self._last.get(request_id)
                if last is None:
                    continue
                body = replace(last, outputs=[_extended(c, *gained) for c, gained in zip(last.outputs, body)])
            if kind == _ERROR or body.finished:
                self._last.pop(request_id, None)
            else:
                self._last[request_id] = body
            outputs.append((request_id, body))
        return outputs

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)


def _extended(completion: CompletionOutput, text: str, token_ids: list[int], logprobs: list | None,
              cumulative_logprob: float | None, finish_reason: str | None,
              stop_reason: int | str | None) -> CompletionOutput:
    return replace(completion, text=completion.text + text, token_ids=completion.token_ids + token_ids,
                   logprobs=None if logprobs is None else completion.logprobs + logprobs,
                   cumulative_logprob=cumulative_logprob, finish_reason=finish_reason, stop_reason=stop_reason)
