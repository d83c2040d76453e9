"""Data parallelism for serving: N engine processes (replicas, each a ProcessCore with its own copy of the model on
its own GPUs) behind one AsyncLLM, which sees one core. A new request goes to the replica with the fewest requests
in flight; its aborts follow it there. The stats are the replicas' summed. A replica that dies stops the whole: the
server reports the engine dead, as it does for one engine process."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from fasterllm.config import EngineArgs
from fasterllm.engine.core_process import ProcessCore
from fasterllm.engine.engine_loop import AbortRequest, AddRequest, Turn
from fasterllm.engine.engine_stats import EngineStats


class DataParallelCore:
    def __init__(self, args: EngineArgs, idle_wait_s: float = 0.05):
        size = args.data_parallel_size
        per_replica = args.tensor_parallel_size
        gpus = _replica_gpus(args, size, per_replica)
        replica_args = dataclasses.replace(args, data_parallel_size=1)
        self.replicas: list[ProcessCore] = []
        try:
            for index in range(size):
                self.replicas.append(ProcessCore(replica_args, idle_wait_s, visible_devices=gpus[index]))
        except BaseException:
            self.shutdown(timeout_s=5)
            raise
        first = self.replicas[0]
        self.model_name, self.max_model_len = first.model_name, first.max_model_len
        self.tokenizer, self.inputs = first.tokenizer, first.inputs
        self._stats = [replica.stats for replica in self.replicas]
        self.stats = _summed(self._stats)
        self.in_flight = [0] * size  # requests sent to each replica and not finished
        self.requests_sent = [0] * size
        self._replica_of: dict[str, int] = {}
        self._on_turn: Callable[[Turn], None] | None = None

    def start(self, on_turn: Callable[[Turn], None]) -> None:
        self._on_turn = on_turn
        for index, replica in enumerate(self.replicas):
            replica.start(lambda turn, index=index: self._turn_of(index, turn))

    def _turn_of(self, index: int, turn: Turn) -> None:
        for request_id in turn.ended_request_ids():  # an aborted one is done already (send)
            self._done(request_id)
        if turn.stats is not None:
            self._stats[index] = turn.stats
            turn.stats = self.stats = _summed(self._stats)
        if turn.dead_reason is not None:
            turn.dead_reason = f"data-parallel replica {index} of {len(self.replicas)}: {turn.dead_reason}"
        self._on_turn(turn)

    def _done(self, request_id: str) -> None:
        index = self._replica_of.pop(request_id, None)
        if index is not None:
            self.in_flight[index] -= 1

    @property
    def alive(self) -> bool:
        return all(replica.alive for replica in self.replicas)

    def send(self, command) -> None:
        if isinstance(command, AddRequest):
            index = min(range(len(self.replicas)), key=self.in_flight.__getitem__)
            self._replica_of[command.request_id] = index
            self.in_flight[index] += 1
            self.requests_sent[index] += 1
            self.replicas[index].send(command)
        elif isinstance(command, AbortRequest):
            index = self._replica_of.get(command.request_id)
            if index is not None:
                self._done(command.request_id)
                self.replicas[index].send(command)
            else:  # finished already, in a replica's turn that has been handed on: nothing of it follows (AsyncLLM
                # takes this turn inside its abort(), which has made the future this turn resolves before sending)
                self._on_turn(Turn(aborted=[command.request_id]))
        else:
            for replica in self.replicas:
                replica.send(command)

    def shutdown(self, timeout_s: float) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout_s)


def _replica_gpus(args: EngineArgs, size: int, per_replica: int) -> list[str | None]:
    """Each replica's GPUs (CUDA_VISIBLE_DEVICES), tensor_parallel_size each, in order; None on the CPU, where the
    replicas share the cores."""
    if args.resolve_device().type != "cuda":
        return [None] * size
    available = torch.cuda.device_count()
    if size * per_replica > available:
        raise ValueError(f"data_parallel_size={size} x tensor_parallel_size={per_replica} needs {size * per_replica} "
                         f"GPUs, but {available} are visible; use sizes whose product is at most {available}")
    return [",".join(str(gpu) for gpu in range(index * per_replica, (index + 1) * per_replica))
            for index in range(size)]


def _summed(stats: list[EngineStats]) -> EngineStats:
    blocks = sum(s.num_kv_blocks for s in stats)
    fields = {f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(EngineStats)}
    fields["kv_cache_usage"] = sum(s.kv_cache_usage * s.num_kv_blocks for s in stats) / blocks if blocks else 0.0
    return EngineStats(**fields)
