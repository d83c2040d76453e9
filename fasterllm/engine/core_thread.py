"""The engine loop on a thread of the server's own process: no IPC, and the Engine stays reachable from the server
side (debugging, tests that make a step fail). The HTTP work then shares the interpreter with the engine: for
serving, `core_process.ProcessCore` keeps them apart."""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable

from fasterllm.engine.engine import Engine
from fasterllm.engine.engine_loop import SHUTDOWN, EngineLoop, Turn


class ThreadCore:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer  # the Rust tokenizer is safe to use from the event loop thread
        self.inputs = engine.inputs  # the prompt checks: read-only, so also safe there
        self.stats = engine.stats()
        self._idle_wait_s = idle_wait_s
        self._commands: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self, on_turn: Callable[[Turn], None]) -> None:
        """Run the loop; each turn is handed to on_turn on the event loop running now."""
        loop = asyncio.get_running_loop()
        engine_loop = EngineLoop(self.engine, self._receive, lambda turn: loop.call_soon_threadsafe(on_turn, turn))
        self._thread = threading.Thread(target=engine_loop.run, name="fasterllm-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def send(self, command) -> None:
        self._commands.put(command)

    def shutdown(self, timeout_s: float) -> None:
        if self.alive:
            self._commands.put(SHUTDOWN)
            self._thread.join(timeout_s)

    def _receive(self, block: bool) -> list:
        commands = []
        try:
            if block:
                commands.append(self._commands.get(timeout=self._idle_wait_s))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands
