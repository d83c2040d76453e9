"""AsyncLLM's side of the engine loop, over a stand-in core: a consumer that falls behind gets the latest cumulative
output only, errors and the end still reach it, a dead engine fails what waits, and an aborted id added again gets
none of the old request's outputs."""
from __future__ import annotations

import asyncio

import pytest

from fasterllm.engine.async_engine import AsyncLLM, EngineDeadError
from fasterllm.engine.engine_loop import AbortRequest, AddRequest, Turn
from fasterllm.outputs import CompletionOutput, RequestOutput
from fasterllm.sampling_params import SamplingParams


class StandInCore:
    model_name, max_model_len, tokenizer, inputs, stats, alive = "m", 64, None, None, None, True

    def __init__(self):
        self.sent, self.on_turn = [], None

    def start(self, on_turn):
        self.on_turn = on_turn

    def send(self, command):
        self.sent.append(command)
        if isinstance(command, AddRequest):  # accepted at once, as the engine loop's next turn would say
            asyncio.get_running_loop().call_soon(self.on_turn, Turn(accepted=[(command.request_id, None)]))

    def shutdown(self, timeout_s):
        self.alive = False


def output(tokens: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, "x" * tokens, list(range(tokens)), None, None,
                                                           "length" if finished else None)], finished)


async def request_with_outputs(*turns: Turn) -> tuple[StandInCore, AsyncLLM]:
    """An AsyncLLM over a stand-in core with request "r" added and these turns delivered before anyone reads."""
    core = StandInCore()
    llm = AsyncLLM(core)
    llm.start()
    await llm.add_request("r", [1], SamplingParams(max_tokens=4))
    for turn in turns:
        core.on_turn(turn)
    return core, llm


def test_a_consumer_behind_the_engine_gets_the_latest_output_and_still_the_end():
    async def run():  # three steps before the consumer reads
        core, llm = await request_with_outputs(*(Turn(outputs=[("r", output(n))]) for n in (1, 2, 3)))
        seen = []
        async for item in llm.outputs("r"):
            seen.append(len(item.outputs[0].token_ids))
            if len(seen) == 1:
                core.on_turn(Turn(outputs=[("r", output(4, finished=True))]))
        return seen

    assert asyncio.run(run()) == [3, 4]


def test_a_dead_engine_fails_a_waiting_consumer():
    async def run():
        _, llm = await request_with_outputs(Turn(outputs=[("r", output(1))]),
                                            Turn(dead_reason="the engine process exited with code -9"))
        got = []
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            async for item in llm.outputs("r"):
                got.append(item)
        assert not llm.healthy
        with pytest.raises(EngineDeadError):
            await llm.add_request("s", [1], SamplingParams(max_tokens=4))
        return got

    assert asyncio.run(run()) == []  # the error, queued behind the output, is what the consumer gets


async def aborted_and_added_again() -> tuple[StandInCore, AsyncLLM, asyncio.Task]:
    """Request "r" with one output read, its consumer stopped (so "r" is aborted), and an add of "r" again started
    (the task) and run up to where it waits."""
    core, llm = await request_with_outputs(Turn(outputs=[("r", output(1))]))
    stream = llm.outputs("r")
    await stream.__anext__()
    await stream.aclose()  # the consumer stops early: "r" is aborted
    assert isinstance(core.sent[-1], AbortRequest)
    again = asyncio.create_task(llm.add_request("r", [1], SamplingParams(max_tokens=4)))
    await asyncio.sleep(0)
    return core, llm, again


def test_an_aborted_id_added_again_waits_for_the_abort_and_gets_only_its_own_outputs():
    """A client stops reading "r" and adds "r" again at once, while a turn with the old request's output is still on
    its way: the new add is sent only once the engine's turn says the abort was applied, and the stale output
    reaches nobody."""
    async def run():
        core, llm, again = await aborted_and_added_again()
        assert not again.done() and isinstance(core.sent[-1], AbortRequest)  # waiting for the abort's turn
        core.on_turn(Turn(outputs=[("r", output(2))]))  # the old request's output, computed before the abort
        core.on_turn(Turn(aborted=["r"]))
        await again  # sent and accepted now
        assert isinstance(core.sent[-1], AddRequest)
        core.on_turn(Turn(outputs=[("r", output(3, finished=True))]))
        return [len(item.outputs[0].token_ids) async for item in llm.outputs("r")]

    assert asyncio.run(run()) == [3]


def test_a_dead_engine_releases_an_add_waiting_for_an_abort():
    async def run():
        core, _, again = await aborted_and_added_again()
        core.on_turn(Turn(dead_reason="the engine process exited with code -9"))
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            await asyncio.wait_for(again, timeout=10)  # not left waiting for a turn that never comes

    asyncio.run(run())


def test_data_parallel_answers_an_abort_of_a_request_no_replica_holds():
    """A request that finished (its last output handed on) has left its replica: the abort's turn comes from the
    data-parallel core itself, or an add of the same id would wait for it for ever."""
    from fasterllm.engine.core_data_parallel import DataParallelCore

    core = DataParallelCore.__new__(DataParallelCore)  # no replica processes: none holds "r"
    core.replicas, core._replica_of, turns = [], {}, []
    core._on_turn = turns.append
    core.send(AbortRequest("r"))
    assert turns == [Turn(aborted=["r"])]


def test_the_engine_loop_says_which_aborts_it_applied_and_the_turn_crosses_processes():
    """The real loop's side of the wait above: a turn that applies an abort names it, also when the engine is
    idle, and the name survives the pickle that carries turns out of the engine's process."""
    import pickle

    from fasterllm.engine.engine_loop import SHUTDOWN, EngineLoop

    class IdleEngine:
        aborted = []

        def abort_request(self, request_id):
            self.aborted.append(request_id)

        def has_unfinished_requests(self):
            return False

        def stats(self):
            return None

    commands, turns = [[AbortRequest("r")], [SHUTDOWN]], []
    EngineLoop(IdleEngine(), lambda idle: commands.pop(0), turns.append).run()
    assert IdleEngine.aborted == ["r"]
    assert pickle.loads(pickle.dumps(turns[0])).aborted == ["r"]
