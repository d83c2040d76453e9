"""One Ray actor per rank, across the nodes of a Ray cluster (`ray start --head` / `ray start --address`), or on
this machine alone when no cluster runs.

The ranks are placed by a placement group, one bundle per GPU (per CPU on a CPU run), packed onto as few nodes as
hold them; rank 0's node hosts the process group's rendezvous (NCCL, or gloo on CPUs). Each step the engine puts its
pickled SchedulerOutput in Ray's object store once and every actor runs it; rank 0 keeps the step's pending output
and hands it over when asked. An actor runs its calls in order, and the engine asks for step N's tokens only after
launching step N + 1 (asynchronous scheduling), so an actor launches the next step before it waits for the last.

Faults: the engine waits on rank 0's answer and on every rank's outstanding steps at once, so a rank that raises or
whose actor dies is named at once; every actor is then killed and the engine fails with WorkerFailedError.
"""
from __future__ import annotations

import os
import pickle
import weakref
from collections import deque
from collections.abc import Callable

from fasterllm.distributed.tensor_parallel import free_port
from fasterllm.executor.ranks import RankExecutor, RankOutput
from fasterllm.worker.step_messages import GrammarMasks, ModelRunnerOutput, SchedulerOutput
from fasterllm.worker.worker import WorkerConfig, call_runner, init_worker


PLACEMENT_TIMEOUT_S = 120  # how long to wait for the cluster to offer every rank its GPU (or CPU)


def _ray():
    try:
        import ray
    except ImportError as exc:
        raise ValueError("distributed_executor_backend='ray' needs Ray; install it with pip install "
                         "'fasterllm[ray]' (or use 'mp' for the GPUs of one machine)") from exc
    return ray


class RayWorker:
    """One rank, as a Ray actor."""

    def node_address(self) -> tuple[str, int]:
        """This node's IP and a free port on it: where rank 0 hosts the group's rendezvous."""
        return _ray().util.get_node_ip_address(), free_port()

    def start(self, rank: int, config: WorkerConfig, init_method: str) -> float:
        # Ray shows an actor only the GPU it was given: device 0 of its own
        self.runner = init_worker(config, rank, init_method, local_gpu=0)
        self.rank, self.pending = rank, deque()
        return self.runner.load_seconds

    def call(self, method: str | Callable, args: tuple):
        return call_runner(self.runner, method, args)

    def execute(self, payload: bytes) -> None:
        message = pickle.loads(payload)
        pending = self.runner.execute(message)
        if self.rank == 0 and pending is not None and not message.masks_follow:
            self.pending.append(pending)

    def sample_with_masks(self, masks: GrammarMasks) -> None:
        pending = self.runner.sample_with_masks(masks)
        if self.rank == 0:
            self.pending.append(pending)

    def next_output(self) -> ModelRunnerOutput:
        return self.pending.popleft().get()


class RayExecutor(RankExecutor):
    rank_label = " (Ray actor)"

    def __init__(self, config: WorkerConfig):
        ray = _ray()
        args = config.args
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        size, gpus = args.tensor_parallel_size, args.resolve_device().type == "cuda"
        if not ray.is_initialized():
            try:  # the cluster this node belongs to (RAY_ADDRESS, or the one `ray start` made here)
                ray.init(address="auto")
            except ConnectionError:  # none: one on this machine, with room for every rank (CPU ranks share cores)
                ray.init(num_cpus=max(os.cpu_count() or 1, size))
        bundle = {"GPU": 1, "CPU": 1} if gpus else {"CPU": 1}
        group = placement_group([bundle] * size, strategy="PACK")
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(group)
            raise ValueError(f"tensor_parallel_size={size} needs {size} x {bundle} from the Ray cluster, which has "
                             f"{ray.available_resources()} free after {PLACEMENT_TIMEOUT_S} s; add nodes or use a "
                             "smaller tensor_parallel_size")
        actor = ray.remote(RayWorker)
        self._actors = [actor.options(num_cpus=1, num_gpus=1 if gpus else 0,
                                      scheduling_strategy=PlacementGroupSchedulingStrategy(group, rank)).remote()
                        for rank in range(size)]
        self._stop = weakref.finalize(self, _stop_actors, self._actors, group)
        self.num_ranks = size
        self._outstanding: dict = {}  # ObjectRef -> rank: every rank's launched steps not known to have finished
        host, port = self._wait(self._actors[0].node_address.remote(), 0)
        starts = [a.start.remote(rank, config, f"tcp://{host}:{port}")
                  for rank, a in enumerate(self._actors)]
        self.load_seconds = max(self._wait(ref, rank) for rank, ref in enumerate(starts))

    def execute(self, message: SchedulerOutput) -> RankOutput | None:
        self._check_alive()
        payload = _ray().put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        self._outstanding.update((actor.execute.remote(payload), rank) for rank, actor in enumerate(self._actors))
        return RankOutput(self, message.sampled_request_ids) if message.runs_anything else None

    def sample_with_masks(self, masks: GrammarMasks) -> None:
        self._check_alive()
        self._outstanding.update((actor.sample_with_masks.remote(masks), rank) for rank, actor in enumerate(self._actors))

    def shutdown(self) -> None:
        self._stop()

    def _call(self, method: str | Callable, *args) -> list:
        self._check_alive()
        refs = [actor.call.remote(method, args) for actor in self._actors]
        return [self._wait(ref, rank) for rank, ref in enumerate(refs)]

    def _wait(self, ref, rank: int):
        """The value of ref (a call on `rank`), watching every outstanding step: a rank that raised or died fails
        all."""
        ray = _ray()
        while True:
            finished = ray.wait([ref, *self._outstanding], num_returns=1)[0][0]
            owner = rank if finished == ref else self._outstanding.pop(finished)
            try:
                value = ray.get(finished)
            except Exception as exc:  # the call raised (RayTaskError) or its actor died (RayActorError)
                self._fail(owner, repr(exc))
            if finished == ref:
                return value

    def _rank0_output(self) -> ModelRunnerOutput:
        return self._wait(self._actors[0].next_output.remote(), 0)  # asked for after the next step was launched

    def _stop_ranks(self) -> None:
        self._stop()


def _stop_actors(actors: list, group) -> None:
    ray = _ray()
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        ray.kill(actor)
    remove_placement_group(group)
