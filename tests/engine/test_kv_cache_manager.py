import pytest

from fasterllm.engine.kv_cache_manager import KVCacheManager
from fasterllm.engine.request import Request
from fasterllm.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt_tokens: int) -> Request:
    return Request(request_id, None, list(range(1, num_prompt_tokens + 1)), SamplingParams(max_tokens=8), [], 1024)


def test_allocation_rounds_up_to_whole_blocks_and_grows_one_block_at_a_time():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", 5)
    assert kv.allocate_slots(request, 5)
    assert len(kv.block_table("a")) == 2  # 5 tokens -> 2 blocks of 4
    request.num_computed_tokens = 5
    for computed in range(5, 8):  # tokens 6..8 still fit in block 2
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens = computed + 1
        assert len(kv.block_table("a")) == 2
    assert kv.allocate_slots(request, 1)  # token 9 needs a third block
    assert len(kv.block_table("a")) == 3
    assert kv.num_free_blocks == 5


def test_block_tables_never_share_blocks():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    for name in "abc":
        assert kv.allocate_slots(make_request(name, 8), 8)
    used = [b for name in "abc" for b in kv.block_table(name)]
    assert sorted(used) == list(range(6))


def test_running_out_takes_nothing_and_freeing_returns_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = make_request("a", 12), make_request("b", 8)
    assert kv.allocate_slots(a, 12)
    assert not kv.allocate_slots(b, 8)  # needs 2, only 1 free
    assert kv.num_free_blocks == 1 and kv.block_table("b") == []
    assert kv.usage == pytest.approx(0.75)
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.usage == 0.0
    assert kv.allocate_slots(b, 8)
    assert len(kv.block_table("b")) == 2


def test_a_shared_write_block_needs_a_free_block_even_where_the_table_holds_spare_blocks():
    """A table holding more blocks than its next tokens need (taken ahead) must not count them against the private
    copy its shared write block needs: with the pool empty the allocation is refused, taking nothing."""
    kv = KVCacheManager(num_blocks=3, block_size=4)
    parent, child = make_request("p", 8), make_request("c", 8)
    assert kv.allocate_slots(parent, 8)  # two blocks; nothing computed yet
    kv.fork(parent, child)  # the child shares both
    assert kv.allocate_slots(make_request("x", 4), 4)  # the last free block
    assert not kv.allocate_slots(child, 1)  # its write block is shared and no block is free
    assert kv.block_table("c") == kv.block_table("p") and kv.take_pending_copies() == []
