"""The engine-worker contract: the worker's copy of every request, built from pickled step messages alone,
matches the engine's requests and block tables through prompts in chunks, decodes, preemption, a copy-on-write
fork and finishing; and no worker module imports the engine."""
import ast
import pickle
from pathlib import Path

import torch

import fasterllm
from fasterllm.config import SchedulerConfig
from fasterllm.engine.kv_cache_manager import KVCacheManager
from fasterllm.engine.request import Request, RequestStatus
from fasterllm.engine.scheduler import Scheduler
from fasterllm.engine.stop_checker import check_stop
from fasterllm.sampling_params import SamplingParams
from fasterllm.worker.request_states import RequestStates


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int, **params) -> Request:
    base = 1000 * ord(request_id[0])
    return Request(request_id, None, list(range(base, base + num_prompt_tokens)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), [0], 1024)


def step(scheduler: Scheduler, worker: RequestStates, token: int) -> list[str]:
    """One step with the message sent through pickle; checks the worker's view of every scheduled request."""
    out = scheduler.schedule()
    message = pickle.loads(pickle.dumps(out.message))
    worker.update(message)
    assert message.request_ids == [item.request.request_id for item in out.scheduled]
    for item, start, num_new in zip(out.scheduled, message.starts, message.num_new_tokens):
        request, state = item.request, worker.states[item.request.request_id]
        assert (start, num_new) == (request.num_computed_tokens, item.num_new_tokens)
        assert state.token_ids == request.all_token_ids
        assert state.num_prompt_tokens == len(request.prompt_token_ids)
        assert state.block_table == scheduler.kv_cache.block_table(request.request_id)
    scheduler.update(out, {s.request.request_id: token for s in out.scheduled if s.samples})
    for item in out.scheduled:
        if item.samples and (stop := check_stop(item.request, None)) is not None:
            scheduler.finish_request(item.request, *stop)
    return [item.request.request_id for item in out.scheduled]


def test_the_worker_state_follows_chunks_preemption_forks_and_finishes():
    # 10 blocks of 4 tokens: three requests outgrow them, so the latest is preempted and comes back
    scheduler = Scheduler(SchedulerConfig(8, 12, 1024), KVCacheManager(10, 4))
    worker = RequestStates(torch.device("cpu"))
    a, b, c = make_request("a", 14, 10), make_request("b", 6, 10), make_request("c", 5, 3)
    for request in (a, b, c):
        scheduler.add_request(request)
    step(scheduler, worker, 11)  # a's first chunk of 12 tokens
    step(scheduler, worker, 12)
    # a parallel sample of b: shares b's blocks, its last one copied when either writes
    child = Request("b#1", None, b.prompt_token_ids, b.sampling_params, [0], 1024)
    child.all_token_ids, child.output_token_ids = list(b.all_token_ids[:-1]), list(b.output_token_ids[:-1])
    child.num_computed_tokens = b.num_computed_tokens
    child.family = b.family = [b, child]
    scheduler.kv_cache.fork(b, child)
    scheduler.add_forked(child, 99)  # its first token stops nothing: it has 10 to go
    for token in range(13, 30):
        step(scheduler, worker, token)
        if not scheduler.has_unfinished_requests():
            break
    assert scheduler.stats.num_preemptions > 0
    assert all(r.status is RequestStatus.FINISHED for r in (a, b, c, child))
    worker.update(scheduler.schedule().message)  # the message after the last step tells who finished
    assert not worker.states


def test_a_seeded_request_names_a_stream_for_each_sample_and_an_unforked_one_is_dropped_with_it():
    scheduler = Scheduler(SchedulerConfig(8, 64, 1024), KVCacheManager(32, 4))
    worker = RequestStates(torch.device("cpu"))
    request = make_request("s", 6, 4, n=3, temperature=1.0, seed=5)
    request.sample_ids = ["s#1", "s#2"]
    scheduler.add_request(request)
    worker.update(scheduler.schedule().message)
    assert set(worker.generators) == {"s", "s#1", "s#2"}
    # the same draws as a generator seeded the documented way
    expected = torch.Generator().manual_seed(5 + 2 * 1_000_003)
    assert torch.equal(torch.rand(4, generator=worker.row_generators(["s", "s", "s"])[2]),
                       torch.rand(4, generator=expected))
    scheduler.finish_request(request, "abort")  # before its samples were forked
    worker.update(scheduler.schedule().message)
    assert not worker.states and not worker.generators


def test_no_worker_module_imports_the_engine():
    worker_dir = Path(fasterllm.__file__).parent / "worker"
    for path in worker_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("fasterllm.engine"), f"{path.name} imports {node.module}"
