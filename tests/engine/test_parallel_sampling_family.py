"""Parallel sampling's family logic without a model: sample ids, forks sharing the parent's blocks, best_of > n
keeping the most likely samples."""
from fasterllm.config import SchedulerConfig
from fasterllm.engine.kv_cache_manager import KVCacheManager
from fasterllm.engine.parallel_sampling import best_samples, fork_sample, name_samples
from fasterllm.engine.request import Request, RequestStatus
from fasterllm.engine.scheduler import Scheduler
from fasterllm.engine.sequence_forks import SequenceForks
from fasterllm.outputs import CompletionOutput
from fasterllm.sampling_params import SamplingParams


def test_forked_samples_share_the_prompt_blocks_and_join_the_family():
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(SchedulerConfig(8, 64, 1024), kv)
    requests = {}
    parent = Request("p", None, list(range(10, 20)), SamplingParams(n=3, temperature=1.0, max_tokens=4), [0], 1024)
    name_samples(parent)
    assert parent.sample_ids == ["p#1", "p#2"]
    scheduler.add_request(parent)
    out = scheduler.schedule()  # the prompt: 10 tokens in 3 blocks
    forks = SequenceForks(requests, kv, scheduler, [0], 1024)
    children = [fork_sample(forks, parent, token, 10) for token in (31, 32)]
    scheduler.update(out, {"p": 30})
    assert [c.request_id for c in children] == ["p#1", "p#2"] and parent.family == [parent, *children]
    assert all(c.family is parent.family and c.status is RequestStatus.RUNNING for c in children)
    assert [r.output_token_ids for r in parent.family] == [[30], [31], [32]]
    assert all(kv.block_table(c.request_id) == kv.block_table("p") for c in children)
    assert kv.num_free_blocks == 16 - 3  # one copy of the prompt, shared three ways
    assert set(requests) == {"p#1", "p#2"}


def test_best_of_keeps_the_n_most_likely_and_renumbers_them():
    samples = [CompletionOutput(i, f"s{i}", [i], logprob, None, "length") for i, logprob in enumerate([-3.0, -1.0, -2.0])]
    kept = best_samples(samples, SamplingParams(n=2, best_of=3, temperature=1.0))
    assert [(c.text, c.index) for c in kept] == [("s1", 0), ("s2", 1)]
    every = best_samples(samples, SamplingParams(n=3, temperature=1.0))
    assert every == samples
