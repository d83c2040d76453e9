from types import SimpleNamespace

import pytest

from fasterllm.config import SchedulerConfig
from fasterllm.engine.kv_cache_manager import KVCacheManager, SwapSpace
from fasterllm.engine.request import Request, RequestStatus
from fasterllm.engine.scheduler import AsyncScheduler, ScheduledBatch, Scheduler
from fasterllm.engine.stop_checker import check_stop
from fasterllm.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 4) -> Request:
    """Prompts of different requests share no tokens, so the prefix cache stays out of these tests."""
    base = 1000 * ord(request_id[0])
    return Request(request_id, None, list(range(base, base + num_prompt_tokens)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), [0], 1024)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                   max_prefill_tokens_beside_decodes=0, scheduler=Scheduler) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, 1024,
                             max_prefill_tokens_beside_decodes=max_prefill_tokens_beside_decodes)
    return scheduler(config, KVCacheManager(num_blocks, block_size))


def run_step(scheduler: Scheduler, token: int = 7):
    """Schedule, pretend the model sampled `token` for every request that samples, update, and end the requests
    that stop (as the engine's step does)."""
    out = scheduler.schedule()
    scheduler.update(out, {s.request.request_id: token for s in out.scheduled if s.samples})
    for s in out.scheduled:
        if s.samples and (stop := check_stop(s.request, None)) is not None:
            scheduler.finish_request(s.request, *stop)
    return out


def test_prompts_and_decodes_share_a_step_and_arrival_order_is_kept():
    scheduler = make_scheduler()
    a = make_request("a", 10)
    scheduler.add_request(a)
    out = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 10)]
    b = make_request("b", 6)
    scheduler.add_request(b)
    out = run_step(scheduler)
    # running request first (its one decode token), then the new prompt, in one batch
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 6)]
    assert all(s.samples for s in out.scheduled)


def test_token_budget_chunks_a_long_prompt_and_only_the_last_chunk_samples():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", 20)
    scheduler.add_request(a)
    chunks = []
    while not a.output_token_ids:
        out = run_step(scheduler)
        chunks.append((out.scheduled[0].num_new_tokens, out.scheduled[0].samples))
    assert chunks == [(8, False), (8, False), (4, True)]
    assert a.num_computed_tokens == 20 and a.output_token_ids == [7]


def test_budget_is_shared_and_waiting_requests_wait_for_it():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    for name in "abc":
        scheduler.add_request(make_request(name, 6))
    out = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 6), ("b", 4)]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    assert out.num_tokens == 10


def test_beside_decodes_prompts_take_at_most_the_prefill_cap_and_alone_the_whole_budget():
    scheduler = make_scheduler(max_num_batched_tokens=32, max_prefill_tokens_beside_decodes=5)
    scheduler.add_request(make_request("a", 20))
    assert [(s.request.request_id, s.num_new_tokens) for s in run_step(scheduler).scheduled] == [("a", 20)]
    for name in "bc":
        scheduler.add_request(make_request(name, 4))
    # a decodes: the new prompts share 5 tokens (b whole, c's first chunk), then c goes on within the cap
    steps = [[(s.request.request_id, s.num_new_tokens) for s in run_step(scheduler).scheduled] for _ in range(2)]
    assert steps == [[("a", 1), ("b", 4), ("c", 1)], [("a", 1), ("b", 1), ("c", 3)]]


def test_a_lookahead_step_keeps_the_prefill_cap_beside_its_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=32, max_prefill_tokens_beside_decodes=5, scheduler=AsyncScheduler)
    scheduler.add_request(make_request("a", 6, max_tokens=8))
    in_flight = scheduler.schedule()
    scheduler.add_request(make_request("b", 12))
    # a's token is in flight: the next step decodes it and admits 5 of b's prompt tokens
    ahead = scheduler.schedule_lookahead(in_flight, ["a"])
    assert [(s.request.request_id, s.num_new_tokens, s.lookahead) for s in ahead.scheduled] == [
        ("a", 1, True), ("b", 5, False)]


def test_an_encoder_longer_than_the_prefill_cap_still_starts_and_the_queue_behind_it_moves():
    """Its encoder runs whole beside its first chunk: the step's budget must hold it, the cap only bounds the chunk,
    and it uses up the step's prompt budget (the plain prompt behind it starts a step later)."""
    scheduler = make_scheduler(max_num_batched_tokens=32, max_prefill_tokens_beside_decodes=5)
    scheduler.add_request(make_request("a", 4, max_tokens=8))
    run_step(scheduler)
    encoder_decoder = Request("e", None, [1], SamplingParams(max_tokens=4, ignore_eos=True), [0], 1024,
                              encoder_token_ids=list(range(12)))
    scheduler.add_request(encoder_decoder)
    scheduler.add_request(make_request("b", 4))
    steps = [[(s.request.request_id, s.num_new_tokens) for s in run_step(scheduler).scheduled] for _ in range(2)]
    assert steps == [[("a", 1), ("e", 1)], [("a", 1), ("e", 1), ("b", 4)]]


def test_a_search_wider_than_the_prefill_cap_is_refused():
    scheduler = make_scheduler(max_prefill_tokens_beside_decodes=4)
    search = make_request("s", 4)
    search.group = SimpleNamespace(width=8)
    with pytest.raises(ValueError, match="beam_width=8 is more than max_prefill_tokens_beside_decodes=4"):
        scheduler.add_request(search)


def test_a_prompt_swapped_back_in_beside_decodes_keeps_the_prefill_cap():
    config = SchedulerConfig(8, 32, 1024, preemption_mode="swap", max_prefill_tokens_beside_decodes=3)
    scheduler = Scheduler(config, KVCacheManager(64, 4), SwapSpace(64))
    scheduler.add_request(make_request("a", 4, max_tokens=20))
    run_step(scheduler)
    scheduler.add_request(make_request("b", 16))
    run_step(scheduler)  # a decodes, b's first 3 prompt tokens
    b = scheduler.running.pop()
    scheduler._preempt(b, ScheduledBatch())  # as a step short of blocks would: b's KV to the CPU pool mid-prompt
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 3
    out = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 3)]
    assert out.message.swap_in


def test_max_num_seqs_limits_admission():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 3))
    out = run_step(scheduler)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_finished_request_frees_blocks_and_a_waiting_one_joins_the_next_step():
    scheduler = make_scheduler(num_blocks=2, block_size=4, max_num_seqs=8)
    a, b = make_request("a", 3, max_tokens=2), make_request("b", 4, max_tokens=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = run_step(scheduler)  # a and b both fit one block each; b finishes after 1 token
    assert {s.request.request_id for s in out.scheduled} == {"a", "b"}
    assert b.finished and b.finish_reason == "length"
    assert scheduler.kv_cache.num_free_blocks == 1  # b's block is back at once
    c = make_request("c", 4)
    scheduler.add_request(c)
    out = run_step(scheduler)
    assert [s.request.request_id for s in out.scheduled] == ["a", "c"]


def test_out_of_blocks_preempts_the_latest_request_by_recompute_and_keeps_its_tokens():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    a, b = make_request("a", 4, max_tokens=4), make_request("b", 3, max_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_step(scheduler)  # one block each; each sampled 1 token
    out = run_step(scheduler)  # a needs a second block: b, the latest, is preempted
    assert out.preempted == [b]
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [7] and b.num_tokens == 4  # generated token kept, recomputed later
    assert scheduler.waiting[0] is b and scheduler.stats.num_preemptions == 1
    while not a.finished:
        run_step(scheduler)
    out = run_step(scheduler)  # a finished and freed its blocks: b recomputes prompt + its token
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 4)]


def test_finish_request_removes_waiting_and_running_requests():
    scheduler = make_scheduler()
    a, b = make_request("a", 4), make_request("b", 4)
    scheduler.add_request(a)
    run_step(scheduler)
    scheduler.add_request(b)
    scheduler.finish_request(a, "abort")
    scheduler.finish_request(b, "abort")
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    assert a.finish_reason == b.finish_reason == "abort"


def test_a_request_that_could_never_fit_is_rejected_not_queued():
    scheduler = make_scheduler(num_blocks=4, block_size=4)  # 16 tokens in all
    with pytest.raises(ValueError, match="needs up to 5 KV blocks .* but the pool has 4; it could never run"):
        scheduler.add_request(make_request("a", 10, max_tokens=10))
    assert not scheduler.has_unfinished_requests()
