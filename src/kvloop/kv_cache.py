"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, per-request block tables,
reference counts, and prefix caching by chained block hashes. No tensors: the runner owns
the memory, this module decides which block holds which tokens.

A full block is identified by hash(parent block's hash, its tokens). On a lookup the
tokens and the parent block are compared too, so a hash collision can only cause a miss,
never a wrong answer. Freed blocks keep their contents and stay findable until the pool
needs them again, evicted least recently freed first.

KV cache groups (sliding-window attention). The layers are split into groups of equal
size by attention type (models.attention.kv_cache_groups): Gemma 3's 3 global + 15 local
layers are one full group and five sliding groups of 3 layers. Every group has its own
block table per request, all drawing on the one pool: a block is a block of the group's
layers, the same bytes whichever group holds it. A sliding group with window W drops
(returns to the pool) every block whose positions all lie before c - W + 1, c being the
first position still to compute (the earliest query of the step, chunked prefill and
drafts included), and leaves None in its table: attention never reads there (the runner
maps it to NULL_BLOCK_ID). So a 4,000-token Gemma 3 sequence holds 250 blocks in its full
group and about (W + chunk) / block_size in each sliding group. Chosen over per-layer
tables (vLLM V1's hybrid manager is the model): a group's layers share one table, so the
per-step bookkeeping scales with the number of groups, not layers, and a model without
sliding layers is one group, exactly the single table of before.

Prefix caching with groups: full groups chain as above; a sliding group's blocks are
cached under the same chain hashes, checked by their tokens and their parent's hash (the
parent itself may be long dropped). A hit must hold, in every sliding group, the blocks
of the window before the hit point; where one is missing, the hit is shortened.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvloop.request import Request


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and cached: what it holds, and what precedes it.
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    parent: Block | None = None
    # The chain hash before this block: what a sliding group's lookup compares, since
    # it keeps no parent (dropped blocks come and go).
    parent_hash: int | None = None
    group: int = 0  # the KV cache group whose prefix cache holds it

    def reset(self) -> None:
        self.block_hash, self.token_ids, self.parent = None, (), None
        self.parent_hash, self.group = None, 0


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def prompt_block_hashes(token_ids: Sequence[int], block_size: int,
                        max_blocks: int | None = None) -> list[int]:
    """The chain hashes of the prompt's leading full blocks, as the prefix cache keys them
    (at most `max_blocks`): what a router in front of several engines compares to send a
    prompt where its prefix is likely cached. Like the cache's lookup, the last token is
    never part of a hashed block (its logits must be computed)."""
    n = (len(token_ids) - 1) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    hashes: list[int] = []
    parent: int | None = None
    for i in range(n):
        parent = chain_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes


class BlockPool:
    """All blocks; free ones (ref_count 0) in an LRU queue, cached ones in a hash map
    per KV cache group.

    The runner's KV tensors are allocated untouched, so a block's memory becomes resident
    the first time the block is written. Blocks never used yet are kept apart ("fresh"),
    and an allocation takes, in order: a free block holding nothing findable; a fresh
    block, while the free blocks still cached hold fewer than `cache_reserve`; the least
    recently freed cached block (its contents evicted); a fresh block. So the resident
    set grows with the blocks running requests need at once plus the reserve kept for
    prefix hits, not with every distinct prompt served until the whole pool is resident
    (a server's memory would creep up to kv_cache_memory over a day of unrelated
    requests). `cache_reserve=None` keeps every freed block until the pool is full."""

    def __init__(self, num_blocks: int, num_groups: int = 1,
                 cache_reserve: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._fresh = list(reversed(self.blocks))  # never used; pop() takes the lowest id
        self._free: OrderedDict[int, Block] = OrderedDict()  # used before, LRU first
        self._num_free_cached = 0  # of _free, the blocks with a block_hash
        self.cache_reserve = num_blocks if cache_reserve is None else cache_reserve
        self._cached_by_group: list[dict[int, Block]] = [{} for _ in range(num_groups)]
        self._cached = self._cached_by_group[0]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._fresh)

    @property
    def num_resident(self) -> int:
        """Blocks used at least once: the pool's memory the process has touched."""
        return len(self.blocks) - len(self._fresh)

    def allocate(self) -> Block:
        """Take a free block (in the order of the class docstring), evicting its cached
        contents."""
        if self._free and (next(iter(self._free.values())).block_hash is None
                           or not self._fresh or self._num_free_cached >= self.cache_reserve):
            _, block = self._free.popitem(last=False)
        else:
            block = self._fresh.pop()  # IndexError when nothing is free: callers check first
        if block.block_hash is not None:
            self._num_free_cached -= 1
            cached = self._cached_by_group[block.group]
            if cached.get(block.block_hash) is block:
                del cached[block.block_hash]
        block.reset()
        block.ref_count = 1
        return block

    def acquire(self, block: Block) -> None:
        """Share a block (prefix hit or fork): revive it if it sat in the free queue."""
        if block.ref_count == 0:
            del self._free[block.block_id]
            self._num_free_cached -= block.block_hash is not None
        block.ref_count += 1

    def release(self, block: Block) -> None:
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block.block_id} released too often"
        if block.ref_count == 0:
            self._free[block.block_id] = block
            if block.block_hash is None:
                # Nothing findable in it: first to the next allocation (its memory is
                # resident already, and no prefix hit is lost).
                self._free.move_to_end(block.block_id, last=False)
            else:
                self._num_free_cached += 1

    def lookup(self, block_hash: int, token_ids: tuple[int, ...],
               parent: Block | None, group: int = 0) -> Block | None:
        block = self._cached_by_group[group].get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent is not parent:
            return None
        return block

    def lookup_window(self, block_hash: int, token_ids: tuple[int, ...],
                      parent_hash: int | None, group: int) -> Block | None:
        """A sliding group's lookup: tokens and the parent's chain hash must match."""
        block = self._cached_by_group[group].get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent_hash != parent_hash:
            return None
        return block

    def cache(self, block: Block, block_hash: int, token_ids: tuple[int, ...],
              parent: Block | None, group: int = 0, parent_hash: int | None = None) -> None:
        if block.ref_count == 0 and block.block_hash is None and block.block_id in self._free:
            self._num_free_cached += 1  # (blocks are cached while held; kept exact anyway)
        block.block_hash, block.token_ids, block.parent = block_hash, token_ids, parent
        block.parent_hash, block.group = parent_hash, group
        # Keep an existing entry: an identical block cached earlier serves lookups equally.
        self._cached_by_group[group].setdefault(block_hash, block)


NULL_BLOCK_ID = 0  # what a dropped entry of a sliding group's table reads as (never read)


def first_kept_block(first_query: int, window: int | None, block_size: int) -> int:
    """Index of the oldest block a group still needs when the earliest query to compute
    is at position `first_query`: it sees keys from first_query - window + 1 on."""
    if window is None:
        return 0
    return max(0, first_query - window + 1) // block_size


def blocks_for_sequence(num_tokens: int, block_size: int, windows: Sequence[int | None],
                        max_chunk: int) -> int:
    """The most blocks (all groups together) a sequence of `num_tokens` tokens ever holds,
    run in steps of at most `max_chunk` tokens: a full group every block, a sliding group
    those of its window before a step's first query and of the step's own tokens."""
    n = -(-num_tokens // block_size)
    total = 0
    for w in windows:
        if w is None:
            total += n
        else:  # span w - 1 + chunk positions, starting anywhere inside a block
            total += min(n, -(-(w - 1 + min(max_chunk, num_tokens)) // block_size) + 1)
    return total


@dataclass
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found
    bytes_per_block: int = 0  # K and V of one block over the layers of one group
    kv_dtype: str = "fp32"  # how the blocks store K and V (EngineConfig.kv_cache_dtype)
    # Per sequence holding KV (in admission order), the blocks its tables reference over
    # all groups (a block shared by a prefix hit or a fork counts for each sharer).
    seq_blocks: tuple[int, ...] = ()
    # Blocks written at least once: the part of the pool's memory the process has touched.
    num_resident_blocks: int = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def seq_kv_bytes(self) -> tuple[int, ...]:
        """KV bytes each sequence holds (see seq_blocks)."""
        return tuple(n * self.bytes_per_block for n in self.seq_blocks)


@dataclass(frozen=True, slots=True)
class BlockMap:
    """What each block of the pool holds now, for pictures of the pool (the live page):
    one pass over the pool, taken only when someone watches, never on the hot path."""

    # Per block: "f" free, "c" free but still cached (a prefix hit can revive it until it
    # is evicted), "u" held by one sequence, "s" shared (a prefix hit or a fork).
    states: str
    # Per block: the first sequence whose table holds it ("" when free).
    owners: tuple[str, ...]
    bytes_per_block: int

    @property
    def num_used(self) -> int:
        return len(self.states) - self.states.count("f") - self.states.count("c")


class CachedPrefix(list[Block]):
    """Prefix-cache hits: the list holds group 0's blocks (as for a one-group cache);
    `groups` every group's table for the hit (None where a sliding group need not keep
    the block) and `hashes` the chain hash of each hit block."""

    def __init__(self, blocks: Sequence[Block] = (),
                 groups: list[list[Block | None]] | None = None,
                 hashes: list[int] | None = None) -> None:
        super().__init__(blocks)
        self.groups = groups if groups is not None else [list(blocks)]
        self.hashes = hashes if hashes is not None else [
            b.block_hash for b in blocks if b.block_hash is not None]


@dataclass
class _Table:
    # One block list per KV cache group; a sliding group's dropped entries are None.
    groups: list[list[Block | None]]
    num_cached: int = 0  # leading blocks already hashed into the prefix cache
    hashes: list[int] = field(default_factory=list)  # chain hash of each of those
    # Per group, how many leading entries are dropped (None).
    num_dropped: list[int] = field(default_factory=list)


class KVCacheManager:
    """Block tables per request and KV cache group, on top of a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark: float = 0.01, group_windows: Sequence[int | None] = (None,),
                 bytes_per_block: int = 0, kv_dtype: str = "fp32",
                 cache_reserve: int | None = None) -> None:
        if not group_windows:
            raise ValueError("the KV cache needs at least one group")
        self.windows = list(group_windows)  # per group: its window, None for full attention
        self.num_groups = len(self.windows)
        self.pool = BlockPool(num_blocks, self.num_groups, cache_reserve)
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block  # as the KV dtype stores them: the real bytes
        self.kv_dtype = kv_dtype
        self.enable_prefix_caching = enable_prefix_caching
        # Admission keeps this many blocks spare, so running requests can grow a little
        # before anyone is preempted (avoids admit-then-preempt thrash).
        self.watermark_blocks = int(watermark * num_blocks)
        self._tables: dict[str, _Table] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies owed
        self._sliding = [g for g, w in enumerate(self.windows) if w is not None]

    # -- queries --------------------------------------------------------------------------
    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        table = self._tables.get(request_id)
        if table is None:
            return []
        if self.windows[group] is None:
            return [b.block_id for b in table.groups[group]]  # type: ignore[union-attr]
        return [NULL_BLOCK_ID if b is None else b.block_id for b in table.groups[group]]

    def group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The tables of groups 1.. (group 0's is block_ids); () for a one-group cache."""
        return tuple(self.block_ids(request_id, g) for g in range(1, self.num_groups))

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a sequence of `num_tokens` holds over all groups."""
        return blocks_for_sequence(num_tokens, self.block_size, self.windows, max_chunk)

    def max_tokens(self, num_blocks: int, max_chunk: int, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) whose blocks fit in `num_blocks`."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_needed(mid, max_chunk) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def group_num_blocks(self, request_id: str) -> list[int]:
        """Per group, the blocks the request's table references now (dropped ones not)."""
        table = self._tables.get(request_id)
        if table is None:
            return [0] * self.num_groups
        return [len(blocks) - d for blocks, d in zip(table.groups, table.num_dropped,
                                                     strict=True)]

    def stats(self) -> KVCacheStats:
        # Read every step (the async engine publishes a snapshot): kept to one pass.
        if self.num_groups == 1:
            seq_blocks = tuple(len(t.groups[0]) - t.num_dropped[0]
                               for t in self._tables.values())
        else:
            seq_blocks = tuple(sum(len(b) - d for b, d in zip(t.groups, t.num_dropped,
                                                              strict=True))
                               for t in self._tables.values())
        return KVCacheStats(self.pool.num_blocks, self.pool.num_free,
                            self.prefix_queries, self.prefix_hits, self.bytes_per_block,
                            self.kv_dtype, seq_blocks, self.pool.num_resident)

    def block_map(self) -> BlockMap:
        """Every block's state and first owner (see BlockMap)."""
        owners = [""] * self.pool.num_blocks
        for request_id, table in self._tables.items():
            for blocks in table.groups:
                for b in blocks:
                    if b is not None and not owners[b.block_id]:
                        owners[b.block_id] = request_id
        states = "".join(
            ("s" if b.ref_count > 1 else "u") if b.ref_count
            else ("c" if b.block_hash is not None else "f") for b in self.pool.blocks)
        return BlockMap(states, tuple(owners), self.bytes_per_block)

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """Leading full blocks of the request's tokens already in the cache.

        At least one token is always left to compute: the step that runs it produces the
        logits the next token is sampled from.
        """
        if not self.enable_prefix_caching:
            return CachedPrefix()
        tokens = request.all_token_ids
        bs = self.block_size
        max_blocks = (len(tokens) - 1) // bs
        full = [g for g, w in enumerate(self.windows) if w is None]
        found: list[list[Block]] = [[] for _ in full]
        hashes: list[int] = []
        chunks: list[tuple[int, ...]] = []
        parent_hash: int | None = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = chain_hash(parent_hash, chunk)
            hit = [self.pool.lookup(h, chunk, f[-1] if f else None, g)
                   for g, f in zip(full, found, strict=True)]
            if any(b is None for b in hit):
                break
            for f, b in zip(found, hit, strict=True):
                f.append(b)  # type: ignore[arg-type]
            hashes.append(h)
            chunks.append(chunk)
            parent_hash = h
        if not self._sliding:
            return CachedPrefix(found[0], [list(f) for f in found], hashes)
        return self._window_hits(found, full, hashes, chunks)

    def _window_hits(self, found: list[list[Block]], full: list[int], hashes: list[int],
                     chunks: list[tuple[int, ...]]) -> CachedPrefix:
        """Shorten the full groups' hit until every sliding group holds the blocks of the
        window before it, and build each group's table for that hit."""
        bs = self.block_size
        n = len(hashes)
        if not full:  # no full group bounds the hit: hash as far as the prompt allows
            n = 0
        hits: dict[int, list[Block | None]] = {}
        for g in self._sliding:
            hits[g] = [self.pool.lookup_window(hashes[i], chunks[i],
                                               hashes[i - 1] if i else None, g)
                       for i in range(n)]
        h = n
        while h > 0:
            if all(all(b is not None for b in hits[g][first_kept_block(
                    h * bs, self.windows[g], bs):h]) for g in self._sliding):
                break
            h -= 1
        groups: list[list[Block | None]] = []
        fi = 0
        for g, w in enumerate(self.windows):
            if w is None:
                groups.append(list(found[fi][:h]))
                fi += 1
            else:
                lo = first_kept_block(h * bs, w, bs)
                dropped: list[Block | None] = [None] * lo
                groups.append(dropped + hits[g][lo:h])
        if h == 0:
            return CachedPrefix(groups=[[] for _ in self.windows], hashes=[])
        head = [b for b in groups[0] if b is not None]  # group 0 is full unless all slide
        return CachedPrefix(head if len(head) == h else [], groups, hashes[:h])

    # -- changes --------------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int,
                 cached_prefix: list[Block] | None = None, admitting: bool = False) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False if blocks run out
        (then nothing changed, except that blocks which slid out of a sliding group's
        window went back to the pool: they are never needed again).

        `cached_prefix` (on admission) are prefix-cache hits to share instead of computing.
        A shared, partly filled last block (after a fork) is copied on write: the copy is
        queued in `pending_copies` for the runner to perform before the step's forward.
        """
        table = self._tables.get(request.request_id)
        computed = request.num_computed_tokens
        if table is not None and self._sliding:
            self._drop_slid_out(table, computed)
        if table is None:
            prefix = (cached_prefix.groups if isinstance(cached_prefix, CachedPrefix)
                      else [list(cached_prefix or [])])
            if len(prefix) != self.num_groups and any(prefix):
                raise ValueError("a prefix hit must give every KV cache group's blocks")
            prefix = prefix + [[] for _ in range(self.num_groups - len(prefix))]
            have = [len(p) for p in prefix]
        else:
            prefix = []
            have = [len(blocks) for blocks in table.groups]
        total = self.num_blocks_for(computed + num_new_tokens)
        need = [max(total - n, 0) for n in have]
        cows = self._shared_tails(table, computed) if num_new_tokens else []
        # Hits sitting in the free queue are revived, so they count against free blocks.
        revived = sum(1 for p in prefix for b in p if b is not None and b.ref_count == 0)
        spare = self.watermark_blocks if admitting else 0
        if sum(need) + revived + len(cows) > self.pool.num_free - spare:
            return False
        if table is None:
            table = self._new_table(request.request_id, prefix, cached_prefix)
        for g, i in cows:
            blocks = table.groups[g]
            old = blocks[i]
            assert old is not None
            copy = self.pool.allocate()
            self.pending_copies.append((old.block_id, copy.block_id))
            self.pool.release(old)
            blocks[i] = copy
        for blocks, k in zip(table.groups, need, strict=True):
            for _ in range(k):
                blocks.append(self.pool.allocate())
        return True

    def _new_table(self, request_id: str, prefix: list[list[Block]] | list[list[Block | None]],
                   cached_prefix: list[Block] | None) -> _Table:
        groups: list[list[Block | None]] = []
        for g in range(self.num_groups):
            blocks: list[Block | None] = list(prefix[g]) if g < len(prefix) else []
            for b in blocks:
                if b is not None:
                    self.pool.acquire(b)
            groups.append(blocks)
        if isinstance(cached_prefix, CachedPrefix):
            hashes = list(cached_prefix.hashes)
        else:  # a plain list of hits (one group)
            hashes = [b.block_hash for b in cached_prefix or [] if b.block_hash is not None]
        dropped = [next((i for i, b in enumerate(blocks) if b is not None), len(blocks))
                   for blocks in groups]
        table = _Table(groups, len(groups[0]), hashes, dropped)
        self._tables[request_id] = table
        return table

    def _drop_slid_out(self, table: _Table, first_query: int) -> None:
        """Return to the pool the sliding groups' blocks no query from `first_query` on
        can see."""
        for g in self._sliding:
            blocks = table.groups[g]
            lo = min(first_kept_block(first_query, self.windows[g], self.block_size),
                     len(blocks))
            for i in range(table.num_dropped[g], lo):
                b = blocks[i]
                if b is not None:
                    self.pool.release(b)
                    blocks[i] = None
            table.num_dropped[g] = max(table.num_dropped[g], lo)

    def _shared_tails(self, table: _Table | None, num_computed: int) -> list[tuple[int, int]]:
        """(group, index) of the partly filled block the next token writes into, in each
        group where others share it."""
        if table is None or num_computed % self.block_size == 0:
            return []
        i = num_computed // self.block_size
        out = []
        for g, blocks in enumerate(table.groups):
            b = blocks[i] if i < len(blocks) else None
            if b is not None and b.ref_count > 1:
                out.append((g, i))
        return out

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, request: Request, tokens: list[int] | None = None) -> None:
        """Hash the blocks that became full of computed tokens, so later requests can reuse
        them. `tokens`: the request's committed tokens, when they run past its token list
        (accepted draft tokens not yet appended)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if table is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table.groups[0]))
        if num_full <= table.num_cached:
            return
        if tokens is None:
            tokens = request.all_token_ids
        parent_hash = table.hashes[-1] if table.hashes else None
        for i in range(table.num_cached, num_full):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(parent_hash, chunk)
            for g, blocks in enumerate(table.groups):
                block = blocks[i]
                # Dropped, or shared (forked) and cached already.
                if block is None or block.block_hash is not None:
                    continue
                if self.windows[g] is None:
                    self.pool.cache(block, h, chunk, blocks[i - 1] if i else None, g)
                else:
                    self.pool.cache(block, h, chunk, None, g, parent_hash)
            table.hashes.append(h)
            parent_hash = h
        table.num_cached = num_full

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        # Tail blocks first into the LRU queue, so a prompt's head (most shareable) is
        # evicted last.
        for blocks in table.groups:
            for block in reversed(blocks):
                if block is not None:
                    self.pool.release(block)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep only the blocks that hold the first `num_tokens` tokens (rejected draft
        tokens are dropped); the rest go back to the pool. Slots past `num_tokens` inside
        the last kept block are simply written again later."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = self.num_blocks_for(num_tokens)
        for g, blocks in enumerate(table.groups):
            for block in reversed(blocks[keep:]):
                if block is not None:
                    self.pool.release(block)
            del blocks[keep:]
            table.num_dropped[g] = min(table.num_dropped[g], len(blocks))
        table.num_cached = min(table.num_cached, keep)
        del table.hashes[table.num_cached:]

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` all of the parent's blocks, shared by reference count.

        Full blocks are immutable, so sharing them is free; the partly filled tail is
        copied on write, by whichever sequence writes into it first (see allocate).
        """
        src = self._tables[parent_id]
        for blocks in src.groups:
            for b in blocks:
                if b is not None:
                    self.pool.acquire(b)
        self._tables[child_id] = _Table([list(blocks) for blocks in src.groups],
                                        src.num_cached, list(src.hashes),
                                        list(src.num_dropped))

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
