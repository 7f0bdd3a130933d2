"""BlockPool and KVCacheManager: ref counts, LRU eviction, prefix caching, fork and
copy-on-write, admission watermark. Pure Python, no model."""

from __future__ import annotations

import pytest

import kvloop.kv_cache as kv_cache
from kvloop.kv_cache import Block, BlockPool, KVCacheManager
from kvloop.params import SamplingParams
from kvloop.request import Request

BS = 4  # block size used throughout


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """What the scheduler does for a running request: room for n tokens, run, hash."""
    assert kv.allocate(req, n)
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)


def admit(kv: KVCacheManager, req: Request) -> list[Block]:
    """Admission with prefix-cache reuse, then the whole rest of the sequence computed."""
    prefix = kv.find_cached_prefix(req)
    req.num_computed_tokens = len(prefix) * kv.block_size
    n = req.num_tokens - req.num_computed_tokens
    assert kv.allocate(req, n, prefix, admitting=True)
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)
    return prefix

def admit_and_fork(kv: KVCacheManager, num_tokens: int) -> tuple[Request, Request]:
    """Parent "p" with tokens 0..num_tokens-1 admitted and computed, and child "c" forked
    from it at the same point (same prompt, same computed tokens), as the engine forks."""
    p = make_request("p", list(range(num_tokens)))
    admit(kv, p)
    c = make_request("c", list(range(num_tokens)))
    kv.fork("p", "c")
    c.num_computed_tokens = p.num_computed_tokens
    return p, c



def ref_counts(kv: KVCacheManager) -> list[int]:
    return [b.ref_count for b in kv.pool.blocks]


# -- BlockPool -------------------------------------------------------------------------------


def test_pool_needs_at_least_one_block() -> None:
    """A pool of zero blocks is refused."""
    with pytest.raises(ValueError):
        BlockPool(0)


def test_pool_allocate_acquire_release_ref_counts() -> None:
    """allocate sets ref 1 and takes a free block; acquire +1; release -1, free again at 0."""
    pool = BlockPool(3)
    assert pool.num_blocks == 3 and pool.num_free == 3
    b = pool.allocate()
    assert (b.block_id, b.ref_count, pool.num_free) == (0, 1, 2)
    pool.acquire(b)
    assert (b.ref_count, pool.num_free) == (2, 2)
    pool.release(b)
    assert (b.ref_count, pool.num_free) == (1, 2)
    pool.release(b)
    assert (b.ref_count, pool.num_free) == (0, 3)


def test_pool_acquire_revives_a_free_block() -> None:
    """Acquiring a block with ref 0 takes it out of the free queue."""
    pool = BlockPool(2)
    b = pool.allocate()
    pool.release(b)
    assert pool.num_free == 2
    pool.acquire(b)
    assert (b.ref_count, pool.num_free) == (1, 1)
    assert pool.allocate().block_id == 1
    assert pool.num_free == 0


def _cached_blocks(pool: BlockPool, n: int) -> list[Block]:
    """n blocks allocated and cached (each its own hash), still held."""
    blocks = [pool.allocate() for _ in range(n)]
    for b in blocks:
        pool.cache(b, 100 + b.block_id, (b.block_id,), None)
    return blocks


def test_pool_evicts_least_recently_freed_first() -> None:
    """Freed cached blocks are reused in the order they were freed."""
    pool = BlockPool(3)
    blocks = _cached_blocks(pool, 3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    for i in (1, 0, 2):
        pool.release(blocks[i])
    assert [pool.allocate().block_id for _ in range(3)] == [1, 0, 2]
    assert pool.lookup(101, (1,), None) is None  # evicted: no longer findable


def test_pool_revived_then_released_block_goes_to_the_back() -> None:
    """A block revived from the free queue and freed again is the most recently freed."""
    pool = BlockPool(3)
    blocks = _cached_blocks(pool, 3)
    for b in blocks:
        pool.release(b)
    pool.acquire(blocks[0])
    pool.release(blocks[0])
    assert [pool.allocate().block_id for _ in range(3)] == [1, 2, 0]


def test_pool_reuses_uncached_blocks_first() -> None:
    """A freed block holding nothing findable is taken before fresh and cached ones (its
    memory is resident, and no prefix hit is lost)."""
    pool = BlockPool(4)
    cached, plain = _cached_blocks(pool, 1)[0], pool.allocate()
    pool.release(cached)
    pool.release(plain)
    assert pool.num_resident == 2
    assert pool.allocate() is plain
    assert pool.allocate().block_id == 2  # then a fresh one: the cached block is kept
    assert pool.lookup(100, (0,), None) is cached and pool.num_resident == 3


def test_pool_cache_reserve_bounds_the_resident_set() -> None:
    """With more freed cached blocks than the reserve, the least recently freed one is
    reused instead of a fresh block: resident blocks stay at what was held at once plus
    the reserve, however many distinct blocks pass through. Without a reserve (None)
    fresh blocks go first until the pool is all resident."""
    # Reserve 2: before each allocation, the cached free blocks are cut to fewer than 2,
    # so 3 blocks are ever resident (at most held-at-once + reserve = 4).
    for reserve, resident in ((2, 3), (None, 16)):
        pool = BlockPool(16, cache_reserve=reserve)
        for round_ in range(8):  # 8 "requests" of 2 blocks each, all cached when freed
            held = [pool.allocate(), pool.allocate()]
            for i, b in enumerate(held):
                pool.cache(b, hash((round_, i)), (round_, i), None)
            for b in held:
                pool.release(b)
        assert pool.num_resident == resident, reserve
        assert pool.num_free == 16
    # With the reserve, the latest freed blocks are still findable: the reserve's worth.
    assert pool.lookup(hash((7, 1)), (7, 1), None) is not None


def test_pool_stats_report_resident_blocks() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    req = Request("a", list(range(9)), SamplingParams(max_tokens=1))
    mgr.allocate(req, 9)
    assert mgr.stats().num_resident_blocks == 3
    mgr.free("a")
    assert mgr.stats().num_resident_blocks == 3 and mgr.stats().num_free_blocks == 8


def test_pool_double_release_asserts() -> None:
    """Releasing a block more often than it was taken is a bug caught by an assert."""
    pool = BlockPool(1)
    b = pool.allocate()
    pool.release(b)
    with pytest.raises(AssertionError, match="released too often"):
        pool.release(b)


def test_pool_lookup_compares_tokens_and_parent() -> None:
    """lookup returns the block only when hash, tokens and parent identity all match."""
    pool = BlockPool(3)
    parent, block, other = pool.allocate(), pool.allocate(), pool.allocate()
    pool.cache(parent, 11, (1, 2), None)
    pool.cache(block, 22, (3, 4), parent)
    assert pool.lookup(11, (1, 2), None) is parent
    assert pool.lookup(22, (3, 4), parent) is block
    assert pool.lookup(22, (3, 5), parent) is None  # same hash, other tokens
    assert pool.lookup(22, (3, 4), other) is None  # same hash and tokens, other parent
    assert pool.lookup(22, (3, 4), None) is None
    assert pool.lookup(33, (3, 4), parent) is None  # unknown hash


def test_pool_cache_keeps_the_first_entry_for_a_hash() -> None:
    """An identical block cached later does not replace the one already in the map."""
    pool = BlockPool(2)
    first, second = pool.allocate(), pool.allocate()
    pool.cache(first, 7, (1, 2), None)
    pool.cache(second, 7, (1, 2), None)
    assert pool.lookup(7, (1, 2), None) is first
    assert second.block_hash == 7


def test_pool_eviction_removes_the_block_from_the_hash_map() -> None:
    """Reusing a freed cached block drops its hash entry, so a new block can take the hash."""
    pool = BlockPool(2)
    old, other = pool.allocate(), pool.allocate()
    pool.cache(old, 5, (1, 2), None)
    pool.release(old)
    assert pool.lookup(5, (1, 2), None) is old  # freed but still findable
    reused = pool.allocate()
    assert reused is old
    assert (reused.block_hash, reused.token_ids, reused.parent) == (None, (), None)
    assert pool.lookup(5, (1, 2), None) is None
    pool.release(other)
    new = pool.allocate()
    assert new is other
    pool.cache(new, 5, (1, 2), None)
    assert pool.lookup(5, (1, 2), None) is new  # a stale entry would have kept `old`


def test_pool_evicting_a_duplicate_keeps_the_mapped_block() -> None:
    """Evicting a block that lost the map entry to an identical one leaves that entry alone."""
    pool = BlockPool(3)
    first, dup = pool.allocate(), pool.allocate()
    pool.cache(first, 9, (1, 2), None)
    pool.cache(dup, 9, (1, 2), None)
    pool.release(dup)
    pool.allocate()  # block 2, never used
    assert pool.allocate() is dup  # evicts the duplicate
    assert pool.lookup(9, (1, 2), None) is first


# -- KVCacheManager: prefix caching ------------------------------------------------------------


def test_block_ids_and_num_blocks_for() -> None:
    """num_blocks_for rounds up; an unknown request has no blocks."""
    kv = KVCacheManager(8, BS, watermark=0.0)
    assert [kv.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert kv.block_ids("nobody") == []


def test_allocate_takes_blocks_as_tokens_grow() -> None:
    """A request gets ceil(tokens / block_size) blocks, one more only when a block fills."""
    kv = KVCacheManager(8, BS, watermark=0.0)
    req = make_request("a", list(range(6)))
    compute(kv, req, 6)
    assert kv.block_ids("a") == [0, 1]
    req.output_token_ids += [100, 101]
    compute(kv, req, 1)
    compute(kv, req, 1)
    assert kv.block_ids("a") == [0, 1]
    req.output_token_ids.append(102)
    compute(kv, req, 1)
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.pool.num_free == 5


def test_allocate_fails_without_changing_anything() -> None:
    """When blocks run out allocate returns False and leaves tables and the pool as they were."""
    kv = KVCacheManager(3, BS, watermark=0.0)
    a = make_request("a", list(range(8)))
    compute(kv, a, 8)
    b = make_request("b", list(range(100, 109)))
    assert not kv.allocate(b, 9)  # needs 3 blocks, 1 free
    assert kv.block_ids("b") == []
    assert kv.pool.num_free == 1
    assert ref_counts(kv) == [1, 1, 0]
    a.output_token_ids.append(50)
    assert not kv.allocate(a, 5)  # 13 tokens need 4 blocks, the pool has 3
    assert kv.block_ids("a") == [0, 1]
    assert kv.pool.num_free == 1


def test_find_cached_prefix_returns_only_full_blocks() -> None:
    """Only full cached blocks are reused; a partial tail is never a hit."""
    kv = KVCacheManager(8, BS, watermark=0.0)
    a = make_request("a", list(range(10)))  # blocks: [0..3] [4..7] [8, 9]
    compute(kv, a, 10)
    b = make_request("b", [*range(10), 77, 78])
    hits = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in hits] == kv.block_ids("a")[:2]
    assert all(len(blk.token_ids) == BS for blk in hits)


def test_find_cached_prefix_leaves_at_least_one_token() -> None:
    """A prompt of exactly k full blocks reuses at most k-1 of them; one more token reuses k."""
    kv = KVCacheManager(8, BS, watermark=0.0)
    a = make_request("a", list(range(8)))
    compute(kv, a, 8)
    a_blocks = kv.block_ids("a")
    exact = make_request("b", list(range(8)))
    assert [blk.block_id for blk in kv.find_cached_prefix(exact)] == a_blocks[:1]
    longer = make_request("c", list(range(9)))
    assert [blk.block_id for blk in kv.find_cached_prefix(longer)] == a_blocks
    one_block = make_request("d", list(range(4)))
    assert kv.find_cached_prefix(one_block) == []


def test_find_cached_prefix_stops_at_first_mismatch() -> None:
    """A differing block ends the prefix even if later blocks match by content."""
    kv = KVCacheManager(8, BS, watermark=0.0)
    a = make_request("a", list(range(13)))
    compute(kv, a, 13)
    b = make_request("b", [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12])
    assert [blk.block_id for blk in kv.find_cached_prefix(b)] == kv.block_ids("a")[:1]
    c = make_request("c", [99, *range(1, 13)])
    assert kv.find_cached_prefix(c) == []


def test_prefix_caching_disabled_never_hits() -> None:
    """With prefix caching off nothing is hashed and nothing is found."""
    kv = KVCacheManager(8, BS, enable_prefix_caching=False, watermark=0.0)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.find_cached_prefix(make_request("b", list(range(9)))) == []


def test_cache_full_blocks_hashes_blocks_as_they_fill() -> None:
    """Blocks are hashed once full of computed tokens, chunk by chunk, generated ones too."""
    kv = KVCacheManager(8, BS, watermark=0.0)
    a = make_request("a", list(range(6)))
    compute(kv, a, 3)  # chunked prefill: block 0 not yet full
    assert kv.pool.blocks[0].block_hash is None
    compute(kv, a, 3)
    b0, b1 = kv.pool.blocks[0], kv.pool.blocks[1]
    assert b0.token_ids == (0, 1, 2, 3) and b0.parent is None
    assert b0.block_hash == kv_cache.chain_hash(None, (0, 1, 2, 3))
    assert b1.block_hash is None  # 2 of 4 tokens
    a.output_token_ids.append(100)
    compute(kv, a, 1)
    assert b1.block_hash is None
    a.output_token_ids.append(101)
    compute(kv, a, 1)
    assert b1.token_ids == (4, 5, 100, 101) and b1.parent is b0
    assert b1.block_hash == kv_cache.chain_hash(b0.block_hash, (4, 5, 100, 101))
    # A later prompt continuing the generated text reuses both blocks.
    b = make_request("b", [0, 1, 2, 3, 4, 5, 100, 101, 7])
    assert kv.find_cached_prefix(b) == [b0, b1]


def test_cache_full_blocks_ignores_allocated_but_uncomputed_tokens() -> None:
    """Blocks allocated for tokens not yet computed are not hashed."""
    kv = KVCacheManager(8, BS, watermark=0.0)
    a = make_request("a", list(range(8)))
    assert kv.allocate(a, 8)
    a.num_computed_tokens = 4
    kv.cache_full_blocks(a)
    assert kv.pool.blocks[0].block_hash is not None
    assert kv.pool.blocks[1].block_hash is None


def test_shared_prefix_ref_counts_and_full_release() -> None:
    """A second request sharing a prefix holds those blocks at ref 2; freeing both frees all."""
    kv = KVCacheManager(8, BS, watermark=0.0)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    assert kv.block_ids("a") == [0, 1, 2]
    b = make_request("b", [*range(8), 50, 51, 52])
    hits = admit(kv, b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert kv.block_ids("b") == [0, 1, 3]
    assert ref_counts(kv)[:4] == [2, 2, 1, 1]
    assert kv.pool.num_free == 4
    kv.free("a")
    assert ref_counts(kv)[:4] == [1, 1, 0, 1]
    kv.free("b")
    kv.free("b")  # freeing twice is harmless
    assert kv.pool.num_free == kv.pool.num_blocks == 8
    assert ref_counts(kv) == [0] * 8
    assert kv.block_ids("a") == kv.block_ids("b") == []


def test_freed_blocks_stay_findable_and_are_revived() -> None:
    """A freed cached prefix is found again and revived out of the free queue."""
    kv = KVCacheManager(4, BS, watermark=0.0)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free("a")
    assert kv.pool.num_free == 4
    b = make_request("b", list(range(9)))
    hits = admit(kv, b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert b.num_computed_tokens == 9
    assert kv.block_ids("b")[:2] == [0, 1]
    assert ref_counts(kv)[:2] == [1, 1]
    assert kv.pool.num_free == 1


def test_revived_prefix_hits_count_against_free_blocks() -> None:
    """Hits in the free queue use free blocks: admission fails if they plus new blocks don't fit."""
    kv = KVCacheManager(4, BS, watermark=0.0)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free("a")
    # 8 cached tokens (2 revived blocks) + 9 new tokens (3 blocks) = 5 > 4 blocks.
    b = make_request("b", [*range(8), *range(100, 109)])
    prefix = kv.find_cached_prefix(b)
    assert len(prefix) == 2
    b.num_computed_tokens = 8
    assert not kv.allocate(b, 9, prefix)
    assert kv.pool.num_free == 4
    assert ref_counts(kv) == [0, 0, 0, 0]
    assert kv.block_ids("b") == []
    assert kv.find_cached_prefix(b) == prefix  # still cached
    # 8 cached + 8 new tokens = 4 blocks: fits exactly.
    assert kv.allocate(b, 8, prefix)
    assert kv.block_ids("b")[:2] == [0, 1]
    assert kv.pool.num_free == 0


def test_live_prefix_hits_do_not_count_against_free_blocks() -> None:
    """Hits held by a running request cost no free block."""
    kv = KVCacheManager(4, BS, watermark=0.0)
    a = make_request("a", list(range(9)))
    admit(kv, a)  # 3 blocks, 1 free
    b = make_request("b", [*range(8), 60])
    prefix = kv.find_cached_prefix(b)
    b.num_computed_tokens = 8
    assert kv.allocate(b, 1, prefix)
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.pool.num_free == 0


def test_free_releases_tail_first_so_head_is_evicted_last() -> None:
    """After a request is freed, its tail blocks are reused before its head blocks."""
    kv = KVCacheManager(4, BS, watermark=0.0)
    a = make_request("a", list(range(13)))  # 3 full blocks + 1 partial
    admit(kv, a)
    assert kv.block_ids("a") == [0, 1, 2, 3]
    kv.free("a")
    b = make_request("b", [100])
    admit(kv, b)
    assert kv.block_ids("b") == [3]  # the partial tail goes first
    c = make_request("c", [200])
    admit(kv, c)
    assert kv.block_ids("c") == [2]  # then the last full block
    again = make_request("a2", list(range(13)))
    assert [blk.block_id for blk in kv.find_cached_prefix(again)] == [0, 1]


def test_hash_collision_only_causes_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every hash equal, a block holding other tokens or another parent is not returned."""
    monkeypatch.setattr(kv_cache, "chain_hash", lambda parent_hash, token_ids: 0)
    kv = KVCacheManager(8, BS, watermark=0.0)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    # Different tokens, same (colliding) hash: a miss, not block 0.
    b = make_request("b", [*range(10, 18), 5])
    assert kv.find_cached_prefix(b) == []
    # Block 1's tokens as a first block: same hash and tokens, wrong parent.
    c = make_request("c", [4, 5, 6, 7, 1])
    assert kv.find_cached_prefix(c) == []
    # The genuine prefix still hits its first block (the map holds one entry per hash).
    d = make_request("d", list(range(9)))
    assert [blk.block_id for blk in kv.find_cached_prefix(d)] == [0]


def test_stats_report_blocks_and_prefix_hits() -> None:
    """stats() reports used/free blocks and the prefix hit rate from record_prefix_lookup."""
    kv = KVCacheManager(8, BS, watermark=0.0)
    assert kv.stats().prefix_hit_rate == 0.0
    admit(kv, make_request("a", list(range(9))))
    kv.record_prefix_lookup(9, 0)
    kv.record_prefix_lookup(9, 8)
    s = kv.stats()
    assert (s.num_blocks, s.num_free_blocks, s.num_used_blocks) == (8, 5, 3)
    assert (s.prefix_queries, s.prefix_hits) == (18, 8)
    assert s.prefix_hit_rate == pytest.approx(8 / 18)


# -- KVCacheManager: fork and copy-on-write ----------------------------------------------------


def test_fork_shares_every_block() -> None:
    """fork gives the child the parent's block table, every ref count +1."""
    kv = KVCacheManager(8, BS, watermark=0.0)
    p = make_request("p", list(range(6)))
    admit(kv, p)
    kv.fork("p", "c")
    assert kv.block_ids("c") == kv.block_ids("p") == [0, 1]
    assert ref_counts(kv)[:3] == [2, 2, 0]
    assert kv.pool.num_free == 6
    assert kv.take_copies() == []


def test_first_writer_into_shared_partial_tail_gets_a_copy() -> None:
    """The first sequence to write into a shared partial block is given a copy; the other
    keeps the original and then writes in place."""
    kv = KVCacheManager(8, BS, watermark=0.0)
    p, c = admit_and_fork(kv, 6)
    c.output_token_ids.append(100)
    p.output_token_ids.append(200)

    assert kv.allocate(c, 1)
    assert kv.block_ids("c") == [0, 2]
    assert kv.block_ids("p") == [0, 1]
    assert ref_counts(kv)[:3] == [2, 1, 1]
    assert kv.pool.num_free == 5
    assert kv.take_copies() == [(1, 2)]
    assert kv.take_copies() == []  # taken once

    assert kv.allocate(p, 1)  # now the sole owner: writes in place
    assert kv.block_ids("p") == [0, 1]
    assert kv.take_copies() == []
    assert kv.pool.num_free == 5

    kv.free("p")
    kv.free("c")
    assert kv.pool.num_free == 8
    assert ref_counts(kv) == [0] * 8


def test_parent_writing_first_gets_the_copy() -> None:
    """Copy-on-write is symmetric: if the parent writes first, the parent's table changes."""
    kv = KVCacheManager(8, BS, watermark=0.0)
    p = make_request("p", list(range(6)))
    admit(kv, p)
    kv.fork("p", "c")
    p.output_token_ids.append(200)
    assert kv.allocate(p, 1)
    assert kv.block_ids("p") == [0, 2]
    assert kv.block_ids("c") == [0, 1]
    assert kv.take_copies() == [(1, 2)]


def test_fork_at_block_boundary_needs_no_copy() -> None:
    """When the shared tail is full, the next token goes to a fresh block: no copy."""
    kv = KVCacheManager(8, BS, watermark=0.0)
    _, c = admit_and_fork(kv, 8)
    c.output_token_ids.append(100)
    assert kv.allocate(c, 1)
    assert kv.block_ids("c") == [0, 1, 2]
    assert kv.block_ids("p") == [0, 1]
    assert kv.take_copies() == []
    assert ref_counts(kv)[:3] == [2, 2, 1]


def test_copy_on_write_fails_cleanly_without_a_free_block() -> None:
    """If no block is free for the copy, allocate returns False and records no copy."""
    kv = KVCacheManager(2, BS, watermark=0.0)
    _, c = admit_and_fork(kv, 6)
    c.output_token_ids.append(100)
    assert kv.pool.num_free == 0
    assert not kv.allocate(c, 1)
    assert kv.block_ids("c") == [0, 1]
    assert ref_counts(kv) == [2, 2]
    assert kv.take_copies() == []


def test_forked_copy_is_cached_when_it_fills() -> None:
    """The child's copied tail is hashed once full, with the child's own tokens."""
    kv = KVCacheManager(8, BS, watermark=0.0)
    _, c = admit_and_fork(kv, 6)
    c.output_token_ids += [100, 101]
    compute(kv, c, 1)
    compute(kv, c, 1)
    copy = kv.pool.blocks[kv.block_ids("c")[1]]
    assert copy.token_ids == (4, 5, 100, 101)
    assert copy.parent is kv.pool.blocks[0]
    q = make_request("q", [0, 1, 2, 3, 4, 5, 100, 101, 9])
    assert kv.find_cached_prefix(q) == [kv.pool.blocks[0], copy]


# -- KVCacheManager: watermark -----------------------------------------------------------------


def test_watermark_applies_at_admission_only() -> None:
    """Admission keeps watermark blocks spare; a running request may use them."""
    kv = KVCacheManager(10, BS, watermark=0.2)
    assert kv.watermark_blocks == 2
    big = make_request("big", list(range(36)))  # 9 blocks
    assert not kv.allocate(big, 36, admitting=True)
    assert kv.pool.num_free == 10 and kv.block_ids("big") == []
    ok = make_request("ok", list(range(32)))  # 8 blocks = 10 - 2
    assert kv.allocate(ok, 32, admitting=True)
    ok.num_computed_tokens = 32
    ok.output_token_ids += [1, 2, 3, 4, 5]
    assert kv.allocate(ok, 5)  # grows into the spare blocks
    assert kv.pool.num_free == 0


def test_default_watermark_rounds_down() -> None:
    """The default 1% watermark is zero blocks on a small pool, one on a pool of 100."""
    assert KVCacheManager(64, BS).watermark_blocks == 0
    assert KVCacheManager(100, BS).watermark_blocks == 1


# -- truncate (speculative decoding's rollback) ----------------------------------------------


def test_truncate_releases_blocks_past_the_kept_tokens() -> None:
    """Blocks holding only rejected draft tokens go back to the pool; a partly kept block
    stays; hashed blocks before the cut keep their hashes."""
    kv = KVCacheManager(8, BS)
    req = make_request("a", list(range(9)))
    compute(kv, req, 9)  # blocks 0, 1 full (hashed), block 2 holds token 8
    assert kv.allocate(req, 6)  # room for 6 more (positions 9..14): blocks 2, 3
    assert len(kv.block_ids("a")) == 4 and kv.pool.num_free == 4
    kv.truncate("a", 10)  # one of the six kept: positions 0..9 live in blocks 0..2
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.pool.num_free == 5 and ref_counts(kv)[3] == 0
    assert kv.pool.blocks[0].block_hash is not None and kv.pool.blocks[1].block_hash is not None
    kv.truncate("a", 8)  # exactly two full blocks
    assert kv.block_ids("a") == [0, 1]
    kv.truncate("unknown", 3)  # no table: nothing to do
    kv.free("a")
    assert kv.pool.num_free == 8 and ref_counts(kv) == [0] * 8
