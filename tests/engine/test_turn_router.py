"""The engine process's turns split by server process (several API servers): each server gets its own requests'
adds, aborts and outputs, and everyone gets the stats and why the engine stopped."""
from __future__ import annotations

from fasterllm.engine.engine_loop import AbortRequest, AddRequest, Turn
from fasterllm.engine.engine_process import TurnRouter
from fasterllm.engine.engine_stats import EngineStats
from fasterllm.outputs import CompletionOutput, RequestOutput


def _output(request_id: str, finished: bool) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[1], outputs=[
        CompletionOutput(index=0, text="x", token_ids=[2], cumulative_logprob=None, logprobs=None)], finished=finished)


def test_each_server_gets_its_own_requests_and_everyone_the_stats():
    router = TurnRouter(2)
    for request_id, server in [("a", 0), ("b", 1), ("c", 1), ("d", 0)]:
        router.came_from(AddRequest(request_id, [1], None, None), server)
    router.came_from(AbortRequest("d"), 0)
    stats = EngineStats(*[0] * 11)
    refused = ValueError("prompt too long")
    failed = RuntimeError("step failed")
    turn = Turn(accepted=[("a", None), ("b", refused)], aborted=["d"],
                outputs=[("a", _output("a", False)), ("c", failed)], stats=stats)
    first, second = router.split(turn)
    assert first.accepted == [("a", None)] and first.aborted == ["d"] and [o[0] for o in first.outputs] == ["a"]
    assert second.accepted == [("b", refused)] and second.aborted == [] and second.outputs == [("c", failed)]
    assert first.stats is stats and second.stats is stats
    # c has failed: an abort its server sent meanwhile still goes back to that server, which waits to hear it
    router.came_from(AbortRequest("c"), 1)
    late = router.split(Turn(aborted=["c"], outputs=[("a", _output("a", True))], stats=stats))
    assert [part.aborted for part in late] == [[], ["c"]] and late[0].outputs[0][1].finished
    dead = router.split(Turn(dead_reason="engine step failed"))
    assert [part.dead_reason for part in dead] == ["engine step failed"] * 2


def test_one_server_gets_the_turn_as_it_is():
    router = TurnRouter(1)
    router.came_from(AddRequest("a", [1], None, None), 0)
    turn = Turn(accepted=[("a", None)], outputs=[("a", _output("a", True))])
    assert router.split(turn) == [turn]


def test_an_abort_applied_twice_in_a_turn_does_not_stop_the_engine():
    router = TurnRouter(2)
    router.came_from(AbortRequest("gone"), 0)
    assert router.split(Turn(aborted=["gone", "gone"]))[0].aborted == ["gone", "gone"]
