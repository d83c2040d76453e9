"""One worker process per rank on this machine (torch.multiprocessing, spawn), driven over pipes.

Each step the engine pickles its SchedulerOutput once and sends it to every rank; every rank runs the same step on
its shard (the collectives inside the model line the ranks up) and samples the same tokens, and rank 0 sends them
back. Rank 0 sends a step's output from a thread, when the GPU has made it, while its main thread already launches
the next step: asynchronous scheduling overlaps host and GPU here as in process.

Faults: a rank whose step raises reports the traceback and exits; the engine waits on every worker's process as
well as on its answer, so a rank that raises or dies is named at once, every worker is stopped, and the engine
fails with WorkerFailedError instead of hanging (a rank stuck in a collective with a dead peer is stopped too).
"""
from __future__ import annotations

import pickle
import queue
import threading
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import torch
import torch.multiprocessing as mp

from fasterllm.distributed.tensor_parallel import free_port
from fasterllm.executor.ranks import RankExecutor, RankOutput
from fasterllm.worker.step_messages import GrammarMasks, ModelRunnerOutput, SchedulerOutput
from fasterllm.worker.worker import WorkerConfig, call_runner, init_worker


class MultiprocExecutor(RankExecutor):
    def __init__(self, config: WorkerConfig):
        context = mp.get_context("spawn")
        size = config.args.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._processes, self._commands, self._results = [], [], []
        for rank in range(size):
            command_reader, command_writer = context.Pipe(duplex=False)
            result_reader, result_writer = context.Pipe(duplex=False)
            process = context.Process(target=run_worker, name=f"fasterllm-rank-{rank}", daemon=True,
                                      args=(rank, config, init_method, command_reader, result_writer))
            process.start()
            command_reader.close()
            result_writer.close()
            self._processes.append(process)
            self._commands.append(command_writer)
            self._results.append(result_reader)
        self.num_ranks = size
        self._stop = weakref.finalize(self, _stop_workers, self._processes, self._commands)
        self.load_seconds = max(self._receive_all())  # each rank's seconds to load its shard

    # ---- what the engine calls (and RankExecutor's methods) ------------------------------------------------
    def execute(self, message: SchedulerOutput) -> RankOutput | None:
        self._send(("step", pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)))
        return RankOutput(self, message.sampled_request_ids) if message.runs_anything else None

    def sample_with_masks(self, masks: GrammarMasks) -> None:
        self._send(("masks", masks))

    def shutdown(self) -> None:
        self._stop()

    # ---- transport ----------------------------------------------------------------------------------------
    def _call(self, method: str | Callable, *args) -> list:
        self._send(("call", (method, args)))
        return self._receive_all()

    def _send(self, command: tuple) -> None:
        self._check_alive()
        for rank, connection in enumerate(self._commands):
            try:
                connection.send(command)
            except OSError:  # its process is gone: _receive names why
                self._receive(rank)

    def _receive_all(self) -> list:
        return [self._receive(rank) for rank in range(len(self._processes))]

    def _receive(self, rank: int):
        """Rank `rank`'s next answer, watching every worker: one that reported a failure or died fails all."""
        self._check_alive()
        connection = self._results[rank]
        while True:
            ready = wait([connection, *(process.sentinel for process in self._processes)])
            if connection in ready:
                try:
                    kind, value = connection.recv()
                except EOFError:  # it exited: the loop finds its sentinel
                    kind, value = None, None
                if kind == "error":
                    self._fail(rank, value)
                if kind is not None:
                    return value
            for failed, process in enumerate(self._processes):
                if process.sentinel in ready or not process.is_alive():
                    process.join(timeout=5)  # its sentinel fires as it exits, a moment before its exit code is known
                    self._fail(failed, _last_error(self._results[failed]) or
                               f"the process exited with code {process.exitcode}")

    def _rank0_output(self) -> ModelRunnerOutput:
        return self._receive(0)

    def _stop_ranks(self) -> None:
        for process in self._processes:  # the others may wait in a collective for the failed one: no stop message
            process.kill()
        self._stop()


def run_worker(rank: int, config: WorkerConfig, init_method: str, commands: Connection, results: Connection) -> None:
    """A worker process: start the rank, then run what the engine sends until told to stop or a call fails."""
    sender = _Sender(results)
    try:
        runner = init_worker(config, rank, init_method)
        sender.put("result", runner.load_seconds)
        while True:
            kind, payload = commands.recv()
            if kind == "stop":
                break
            if kind == "step":
                message = pickle.loads(payload)
                pending = runner.execute(message)
                if rank == 0 and pending is not None and not message.masks_follow:  # else: once its masks came
                    sender.put("output", pending)
            elif kind == "masks":
                pending = runner.sample_with_masks(payload)
                if rank == 0:
                    sender.put("output", pending)
            else:
                sender.put("result", call_runner(runner, *payload))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    except EOFError:  # the engine's process is gone
        pass
    except BaseException:
        sender.put("error", traceback.format_exc())
    sender.close()


class _Sender:
    """Sends a worker's answers in order from a thread: a step's output once its tokens are on the host (the main
    thread launches the next step meanwhile), anything else as it is."""

    def __init__(self, connection: Connection):
        self._connection, self._queue = connection, queue.Queue()
        self._thread = threading.Thread(target=self._run, name="fasterllm-sender", daemon=True)
        self._thread.start()

    def put(self, kind: str, value) -> None:
        self._queue.put((kind, value))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, value = item
            try:
                if kind == "output":
                    kind, value = "result", value.get()
            except BaseException:
                kind, value = "error", traceback.format_exc()
            try:
                self._connection.send((kind, value))
            except OSError:  # the engine is gone
                return


def _last_error(connection: Connection) -> str | None:
    """The traceback a dead worker sent before it exited, if any."""
    try:
        while connection.poll():
            kind, value = connection.recv()
            if kind == "error":
                return value
    except (EOFError, OSError):
        pass
    return None


def _stop_workers(processes: list, commands: list[Connection]) -> None:
    """Rank 0 last: it hosts the group's store, which the others' NCCL watchdogs poll until they have exited."""
    for rank in [*range(1, len(processes)), 0]:
        try:
            commands[rank].send(("stop", None))
        except OSError:
            pass
        processes[rank].join(timeout=10)
        if processes[rank].is_alive():  # stuck in a collective with a failed peer
            processes[rank].kill()
            processes[rank].join()
