"""Typed errors: a bad input, carrying the name of the field it is about; a failed step, naming the requests it failed."""
from __future__ import annotations


class InvalidInputError(ValueError):
    """A bad value in a request or its parameters. The message names the value, the limit and the fix; `param`
    names the field as the user wrote it ("temperature", "prompt", "input"), or is None when no one field is at
    fault. The server answers 400 with it as the OpenAI error's "param"."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # keeps param when the error crosses a process boundary
        return type(self), (str(self), self.param)


class StepFailedError(RuntimeError):
    """The forward pass failed; request_ids are the requests (as added) it failed, whole: their
    parallel samples and beams too. The engine goes on with the others."""

    def __init__(self, request_ids: list[str], cause: Exception):
        super().__init__(f"the forward pass failed for requests {request_ids}: {cause!r}")
        self.request_ids = request_ids


class WorkerFailedError(RuntimeError):
    """A worker process (one rank of a model sharded over several) failed or died. The ranks step together, so the
    engine cannot go on: every worker is stopped and each later call raises this again."""
