"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, per-request block tables,
reference counts, and prefix caching by chained block hashes. No tensors: the runner owns
the memory, this module decides which block holds which tokens.

A full block is identified by hash(parent block's hash, its tokens). On a lookup the
tokens and the parent block are compared too, so a hash collision can only cause a miss,
never a wrong answer. Freed blocks keep their contents and stay findable until the pool
needs them again, evicted least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
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

    def reset(self) -> None:
        self.block_hash, self.token_ids, self.parent = None, (), None


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockPool:
    """All blocks; free ones (ref_count 0) in an LRU queue, cached ones in a hash map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, Block] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> Block:
        """Take the least recently freed block, evicting its cached contents."""
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.reset()
        block.ref_count = 1
        return block

    def acquire(self, block: Block) -> None:
        """Share a block (prefix hit or fork): revive it if it sat in the free queue."""
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def release(self, block: Block) -> None:
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block.block_id} released too often"
        if block.ref_count == 0:
            self._free[block.block_id] = block

    def lookup(self, block_hash: int, token_ids: tuple[int, ...],
               parent: Block | None) -> Block | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent is not parent:
            return None
        return block

    def cache(self, block: Block, block_hash: int, token_ids: tuple[int, ...],
              parent: Block | None) -> None:
        block.block_hash, block.token_ids, block.parent = block_hash, token_ids, parent
        # Keep an existing entry: an identical block cached earlier serves lookups equally.
        self._cached.setdefault(block_hash, block)


@dataclass
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass
class _Table:
    blocks: list[Block] = field(default_factory=list)
    num_cached: int = 0  # leading blocks already hashed into the prefix cache


class KVCacheManager:
    """Block tables per request, on top of a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark: float = 0.01) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Admission keeps this many blocks spare, so running requests can grow a little
        # before anyone is preempted (avoids admit-then-preempt thrash).
        self.watermark_blocks = int(watermark * num_blocks)
        self._tables: dict[str, _Table] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies owed

    # -- queries --------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        table = self._tables.get(request_id)
        return [b.block_id for b in table.blocks] if table else []

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(self.pool.num_blocks, self.pool.num_free,
                            self.prefix_queries, self.prefix_hits)

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """Leading full blocks of the request's tokens already in the cache.

        At least one token is always left to compute: the step that runs it produces the
        logits the next token is sampled from.
        """
        if not self.enable_prefix_caching:
            return []
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        found: list[Block] = []
        parent: Block | None = None
        parent_hash: int | None = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(parent_hash, chunk)
            block = self.pool.lookup(h, chunk, parent)
            if block is None:
                break
            found.append(block)
            parent, parent_hash = block, h
        return found

    # -- changes --------------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int,
                 cached_prefix: list[Block] | None = None, admitting: bool = False) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False if blocks run out
        (then nothing changed).

        `cached_prefix` (on admission) are prefix-cache hits to share instead of computing.
        A shared, partly filled last block (after a fork) is copied on write: the copy is
        queued in `pending_copies` for the runner to perform before the step's forward.
        """
        table = self._tables.get(request.request_id)
        prefix = cached_prefix or []
        have = len(table.blocks) if table else len(prefix)
        need = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - have
        cow = self._shared_tail(table, request.num_computed_tokens) if num_new_tokens else None
        # Hits sitting in the free queue are revived, so they count against free blocks.
        revived = sum(1 for b in prefix if b.ref_count == 0)
        spare = self.watermark_blocks if admitting else 0
        if max(need, 0) + revived + (cow is not None) > self.pool.num_free - spare:
            return False
        if table is None:
            table = self._tables[request.request_id] = _Table()
            for b in prefix:
                self.pool.acquire(b)
            table.blocks.extend(prefix)
            table.num_cached = len(prefix)
        if cow is not None:
            copy = self.pool.allocate()
            self.pending_copies.append((table.blocks[cow].block_id, copy.block_id))
            self.pool.release(table.blocks[cow])
            table.blocks[cow] = copy
        for _ in range(max(need, 0)):
            table.blocks.append(self.pool.allocate())
        return True

    def _shared_tail(self, table: _Table | None, num_computed: int) -> int | None:
        """Index of the partly filled block the next token writes into, if others share it."""
        if table is None or num_computed % self.block_size == 0:
            return None
        i = num_computed // self.block_size
        return i if i < len(table.blocks) and table.blocks[i].ref_count > 1 else None

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
        num_full = min(request.num_computed_tokens // self.block_size, len(table.blocks))
        if num_full <= table.num_cached:
            return
        if tokens is None:
            tokens = request.all_token_ids
        parent = table.blocks[table.num_cached - 1] if table.num_cached else None
        parent_hash = parent.block_hash if parent else None
        for i in range(table.num_cached, num_full):
            block = table.blocks[i]
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(parent_hash, chunk)
            if block.block_hash is None:  # a shared (forked) block may be cached already
                self.pool.cache(block, h, chunk, parent)
            parent, parent_hash = block, h
        table.num_cached = num_full

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        # Tail blocks first into the LRU queue, so a prompt's head (most shareable) is
        # evicted last.
        for block in reversed(table.blocks):
            self.pool.release(block)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep only the blocks that hold the first `num_tokens` tokens (rejected draft
        tokens are dropped); the rest go back to the pool. Slots past `num_tokens` inside
        the last kept block are simply written again later."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = self.num_blocks_for(num_tokens)
        for block in reversed(table.blocks[keep:]):
            self.pool.release(block)
        del table.blocks[keep:]
        table.num_cached = min(table.num_cached, keep)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` all of the parent's blocks, shared by reference count.

        Full blocks are immutable, so sharing them is free; the partly filled tail is
        copied on write, by whichever sequence writes into it first (see allocate).
        """
        src = self._tables[parent_id]
        for b in src.blocks:
            self.pool.acquire(b)
        self._tables[child_id] = _Table(list(src.blocks), src.num_cached)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
