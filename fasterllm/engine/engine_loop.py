"""The loop that owns an Engine: apply the commands that came in, step, hand out what the turn produced.

It runs where the engine lives (a thread of the server's process, or the engine core process) and knows nothing
of how commands arrive or turns leave: `receive(block)` returns the commands that came in (waiting a moment for
the first one when block is true) and `emit(turn)` hands a turn to the server side. Every Engine call happens
here, so the Engine needs no locks.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fasterllm.engine.engine_stats import EngineStats
from fasterllm.errors import StepFailedError
from fasterllm.outputs import RequestOutput
from fasterllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from fasterllm.engine.engine import Engine

logger = logging.getLogger("fasterllm")


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an unrecoverable error, or shutdown); no request can run."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request; other requests may go on."""


@dataclass
class AddRequest:
    request_id: str
    prompt: str | list[int] | dict
    params: SamplingParams | BeamSearchParams
    arrival_time: float | None


@dataclass
class AbortRequest:
    request_id: str


SHUTDOWN = None  # the command that stops the loop


@dataclass
class Turn:
    """What one turn of the loop produced, in order: the adds it accepted (None) or refused (the error), the aborts
    it applied (no output of those requests follows), the outputs (or the error that failed a request), the engine's
    stats after it, and why the loop stopped, if it did."""
    accepted: list[tuple[str, Exception | None]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    outputs: list[tuple[str, RequestOutput | Exception]] = field(default_factory=list)
    stats: EngineStats | None = None
    dead_reason: str | None = None

    def ended_request_ids(self) -> list[str]:
        """The requests of which nothing follows this turn: refused, aborted, failed or finished."""
        return ([request_id for request_id, error in self.accepted if error is not None] + self.aborted
                + [request_id for request_id, output in self.outputs
                   if isinstance(output, Exception) or output.finished])


class EngineLoop:
    def __init__(self, engine: Engine, receive: Callable[[bool], list], emit: Callable[[Turn], None]):
        self.engine = engine
        self.receive = receive
        self.emit = emit

    def run(self) -> None:
        """Turn until a SHUTDOWN command or an error that leaves the engine's state unknown; the last turn emitted
        says why it stopped."""
        try:
            while True:
                turn = Turn()
                commands = self.receive(not self.engine.has_unfinished_requests())
                for command in commands:
                    if command is SHUTDOWN:
                        turn.dead_reason = "the server is shutting down"
                        break
                    self._apply(command, turn)
                if turn.dead_reason is None and self.engine.has_unfinished_requests():
                    self._step(turn)
                if commands or turn.outputs or turn.dead_reason is not None:
                    turn.stats = self.engine.stats()
                    self.emit(turn)
                if turn.dead_reason is not None:
                    return
        except Exception as exc:  # a bug outside step(): nothing can be trusted any more
            logger.exception("engine loop crashed")
            self.emit(Turn(dead_reason=f"engine loop crashed: {exc!r}"))

    def _apply(self, command: AddRequest | AbortRequest, turn: Turn) -> None:
        if isinstance(command, AbortRequest):
            self.engine.abort_request(command.request_id)
            turn.aborted.append(command.request_id)
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, command.arrival_time)
        except Exception as exc:  # ValueError: a bad request, told to its client
            turn.accepted.append((command.request_id, exc))
            return
        turn.accepted.append((command.request_id, None))

    def _step(self, turn: Turn) -> None:
        try:
            outputs = self.engine.step()
        except StepFailedError as exc:  # the engine failed these requests whole and goes on
            logger.error("engine step failed (%r); failed requests %s; the engine goes on", exc, exc.request_ids)
            turn.outputs.extend((rid, RequestFailedError(f"the engine failed while running request {rid}: {exc!r}"))
                                for rid in exc.request_ids)
            return
        except Exception as exc:  # from outside the forward pass: the engine state is unknown
            logger.exception("engine step failed outside the forward pass; stopping the engine")
            turn.dead_reason = f"engine step failed: {exc!r}"
            return
        turn.outputs.extend((output.request_id, output) for output in outputs)
