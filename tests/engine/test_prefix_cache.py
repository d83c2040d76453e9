from fasterllm.engine import kv_cache_manager
from fasterllm.engine.kv_cache_manager import KVCacheManager
from fasterllm.engine.request import Request
from fasterllm.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, None, list(tokens), SamplingParams(max_tokens=4), [], 1024)


def run_prompt(kv: KVCacheManager, request: Request) -> int:
    """Admit the request as the scheduler does, 'compute' its whole prompt, register its blocks."""
    hit = kv.match_prefix(request)
    request.num_computed_tokens = hit
    assert kv.allocate_slots(request, request.num_tokens - hit)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return hit


def test_shared_prefix_reuses_full_blocks_and_computes_only_the_tail():
    kv = KVCacheManager(16, BS)
    first = make_request("a", range(100, 110))  # 2 full blocks + 2 tokens
    assert run_prompt(kv, first) == 0
    second = make_request("b", list(range(100, 108)) + [7, 7, 7])  # shares the 2 full blocks
    assert run_prompt(kv, second) == 8
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2] not in kv.block_table("a")
    assert kv.prefix_cache_hits == 8 and kv.prefix_cache_queries == 10 + 11


def test_a_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(16, BS)
    run_prompt(kv, make_request("a", range(100, 108)))  # exactly 2 blocks
    again = make_request("b", range(100, 108))
    assert run_prompt(kv, again) == 4  # only the first block: the second holds the token to compute


def test_hashes_chain_so_a_different_first_block_changes_every_later_hash():
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    b = make_request("b", [9, 2, 3, 4, 5, 6, 7, 8])  # same second block, different first
    kv = KVCacheManager(16, BS)
    ha, hb = kv._full_block_hashes(a, 2), kv._full_block_hashes(b, 2)
    assert ha[0] != hb[0] and ha[1] != hb[1]
    run_prompt(kv, a)
    assert run_prompt(kv, make_request("c", [9, 2, 3, 4, 5, 6, 7, 8, 0])) == 0


def test_a_hash_collision_is_caught_by_comparing_tokens(monkeypatch):
    monkeypatch.setattr(kv_cache_manager, "block_hash", lambda parent, tokens: 42)  # every block collides
    kv = KVCacheManager(16, BS)
    run_prompt(kv, make_request("a", range(100, 110)))
    assert run_prompt(kv, make_request("b", range(200, 210))) == 0
    assert run_prompt(kv, make_request("c", list(range(100, 104)) + [1, 2, 3])) == 4  # a true hit still works


def test_shared_blocks_are_not_freed_while_referenced():
    kv = KVCacheManager(8, BS)
    a, b = make_request("a", range(100, 110)), make_request("b", list(range(100, 108)) + [5])
    run_prompt(kv, a)
    run_prompt(kv, b)
    shared = kv.block_table("a")[:2]
    assert [kv.ref_counts[x] for x in shared] == [2, 2]
    kv.free(a)
    assert [kv.ref_counts[x] for x in shared] == [1, 1]
    assert not any(x in kv.free_queue for x in shared)
    kv.free(b)
    assert all(x in kv.free_queue for x in shared) and kv.num_free_blocks == 8


def test_freed_cached_blocks_stay_findable_and_are_evicted_least_recently_freed_first():
    kv = KVCacheManager(4, BS)
    a, b = make_request("a", range(100, 105)), make_request("b", range(200, 205))
    run_prompt(kv, a)  # blocks 0 (full, cached) and 1 (partial)
    kv.free(a)  # the tail goes first: eviction order 2, 3, 1, 0
    run_prompt(kv, b)  # takes the never-used 2 and 3
    kv.free(b)  # eviction order now 1, 0, 3, 2
    assert kv.num_cached_blocks == 2 and kv.num_free_blocks == 4
    a2 = make_request("a2", range(100, 105))
    assert run_prompt(kv, a2) == 4  # a's freed block is still found
    kv.free(a2)
    # a 2-block request now evicts the least recently freed blocks: b's partial tail, then b's full block
    run_prompt(kv, make_request("c", range(300, 308)))
    assert run_prompt(kv, make_request("b2", range(200, 205))) == 0
