"""The error a bad input raises, carrying the name of the field it is about."""
from __future__ import annotations


class InvalidInputError(ValueError):
    """A bad value in a request or its parameters. The message names the value, the limit and the fix; `param`
    names the field as the user wrote it ("temperature", "prompt", "input"), or is None when no one field is at
    fault. The server answers 400 with it as the OpenAI error's "param"."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
