"""PrefixCache: reuse a prompt prefix's attention KV rows and GDN state across requests, exactly.

A GDN layer's state cannot be rewound, so the cache keeps snapshots taken at block boundaries. A block is the
engine's prefill chunk C (GraphExecutor.max_chunk, default the artifact's largest): chunk_tokens feeds every chunk
but a prompt's last one C tokens, so each non-last chunk ends on a block boundary and its end is a snapshot point
of the prefill that already runs (no extra pass); and a prefill resumed at a multiple of C runs the very chunk
partition the uncached prefill runs, so a hit is bit-identical to a miss (same logits, same sampled tokens:
sampling depends on the seed and the position only).

Block k of a prompt (tokens [kC, (k+1)C)) is keyed by a sha256 chain: key_k = sha256(key_{k-1} || ids of
block k), key_{-1} = the scope (the artifact's identity, dtype, backend, device: anything that changes the
numbers). Its entry holds (a pool row of each state tensor)
    - per attention KV tensor [S+1, KVH, Tmax, D]: the rows [kC, (k+1)C) of the slot  -> [KVH, C, D];
    - per GDN conv [S+1, Ch, W-1] and recurrent [S+1, HV, K, V] tensor, where the entry has a snapshot
      (`state`): the slot's state after token (k+1)C - 1 (the whole slot row).
So the KV rows of a prefix are shared along the chain (each entry stores its own block's rows once) and a
hit of k blocks needs the entries of blocks 0..k-1, the last with a snapshot (it copies every chain entry's
KV rows and the last one's GDN state).

Snapshots are taken only where a later hit can end, because they are most of a block's bytes (35B: 63 of
74 MB) and a prefill with nothing to share must not pay one per block: at a prompt's last two block
boundaries ((len - 1) // C and len // C blocks: the same prompt again, or one that extends it, as a next
turn does), and at a block a lookup marked `wanted`: a prompt that matched cached blocks past their last
snapshot (it diverges from a cached prompt after them) hits up to that snapshot, marks the deepest block it
matched, and its own prefill snapshots that block on the way, so the prompts that share it next hit there.
A shared system prompt thus costs one extra partial miss per divergence point.

Memory: one pool per state tensor, [N, ...] for N = budget // bytes_per_block blocks, allocated and zeroed once
when the cache is made (a budget that does not fit is refused there; zeroed, so a CPU host commits its pages
then, not as blocks are stored), so storing never allocates: no out-of-memory error mid-request. A block
that finds no free pool row and nothing evictable is not stored. Eviction is LRU over leaves (an entry no
other entry extends) that no request pins: a request pins the chain it matched and the blocks it stored
until its prefill ends, so a chain it extends stays whole.

All copies are tensor ops on the device (a hit, and a block stored, is one torch._foreach_copy_ per state
dtype over views made once), run on the engine thread between graph calls; the host does per-block
bookkeeping only.

Speculative artifacts: the MTP head's KV cache (mtp{i}.k_cache / v_cache, kind "kv") is cached as every
attention layer's: a prefill chunk catches the head up over its positions (head position t on (h_t, x_{t+1}),
x_{t+1} from the prompt), so after a chunk that ends at P the head's rows [0, P) are the miss's; except after a
prompt's last chunk, whose last head row is made on the id sampled there (not the prompt's next token, which
an extending prompt has): a block that ends at its prompt's end is not stored there. The round carry
(kind "spec": spec.y, the head's output at the last prefilled position, and spec.pos) is not cached: every
prefill chunk writes both for its slot before anything reads them, and a hit leaves at least one prompt token
to prefill.

What it refuses (`unsupported`): tensor parallel (each rank owns its state; the copies would have to run on
every rank).
"""
from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
import math

import torch

# a default budget: this fraction of the memory free after the weights, the slots and the workspace, at most
# the blocks of DEFAULT_PROMPTS prompts of max_seq_len tokens (a small model on a large host stays small)
DEFAULT_FRACTION = 0.1
DEFAULT_PROMPTS = 64


def state_kind(meta: dict) -> str:
    """The kind of one state tensor of the manifest ({name, shape, dtype, kind}): "kv" (attention KV cache
    [S, KVH, Tmax, D]), "conv" (GDN conv [S, C, W-1]), "recurrent" (GDN [S, HV, K, V]) or "spec" (the MTP
    head's state). Every manifest row carries it (runtime/artifact.py StateEntry refuses one without)."""
    return meta["kind"]


def unsupported(state_meta: list, tp: int) -> str | None:
    """Why the prefix cache cannot run on this state layout (one line), or None."""
    if tp > 1:
        return f"the prefix cache runs at tp=1 (this artifact is tp={tp}: each rank owns its state)"
    return None


def block_bytes(state_meta: list, block_tokens: int) -> int:
    """Bytes of one cached block: C KV rows of each attention KV tensor (the MTP head's included) + each GDN
    tensor's slot row; the speculative round carry is not cached (module docstring)."""
    from onegraph.graphs.signature import torch_dtype
    n = 0
    for t in state_meta:
        if state_kind(t) == "spec":
            continue
        per_slot = math.prod(t["shape"][1:]) * torch_dtype(t["dtype"]).itemsize
        n += per_slot * block_tokens // t["shape"][2] if state_kind(t) == "kv" else per_slot
    return n


@dataclasses.dataclass(eq=False)
class Entry:
    key: bytes
    parent: "Entry | None"
    row: int                      # the pool row holding it
    blocks: int                   # its depth: the prefix it ends is blocks x C tokens
    children: int = 0
    pins: int = 0
    state: bool = False           # its row holds the GDN state after its last token (a hit may end here)
    wanted: bool = False          # a lookup matched up to here and found no state: the next prefill snapshots it


class PrefixCache:
    def __init__(self, state: list[torch.Tensor], state_meta: list, block_tokens: int, budget_bytes: int,
                 scope: str):
        """state: the executor's state tensors (in state_meta's order); block_tokens: C, the largest prefill
        chunk; budget_bytes: the pools' size (rounded down to whole blocks; < one block: ValueError)."""
        why = unsupported(state_meta, 1)
        if why:
            raise ValueError(why)
        self.C, self.state = block_tokens, state
        self.kinds = [state_kind(t) for t in state_meta]
        self.block_bytes = block_bytes(state_meta, block_tokens)
        self.capacity = budget_bytes // self.block_bytes
        if self.capacity < 1:
            raise ValueError(f"a prefix cache budget of {budget_bytes} bytes holds no block "
                             f"({self.block_bytes} bytes per block of {block_tokens} tokens)")
        # pools: [N, KVH, C, D] per KV tensor, [N, ...] per GDN tensor, none for the round carry; only rows a
        # block wrote are ever read
        self.pools = [None if k == "spec" else
                      torch.zeros((self.capacity, t.shape[1], block_tokens, *t.shape[3:]) if k == "kv"
                                  else (self.capacity, *t.shape[1:]), dtype=t.dtype, device=t.device)
                      for t, k in zip(state, self.kinds)]
        self.free_rows = list(range(self.capacity))
        self.kv = [i for i, k in enumerate(self.kinds) if k == "kv"]
        self.speculative = "spec" in self.kinds   # the MTP head's KV among the KV tensors (module docstring)
        self.gdn = [i for i, k in enumerate(self.kinds) if k in ("conv", "recurrent")]
        # Every copy (a hit: pool rows -> slot, a store: slot -> a pool row) is one torch._foreach_copy_ per
        # dtype (bf16 KV and conv, fp32 recurrent: 2) over views made once, as first used, and kept in
        # self._views (making views was most of a store's host time). On CUDA its fused path (a kernel per
        # ~64 tensors, not one per tensor) needs src and dst of one dtype, dense, of equal sizes and strides;
        # a slot's KV block [KVH, C, D] of [KVH, Tmax, D] is strided, so a KV block is one [C, D] view per KV
        # head. (35B, a hit of 15 blocks: 600 KV views + 60 GDN rows in 2 calls, where an index_select and a
        # copy_ per KV tensor and a copy_ per GDN tensor made ~100 ops; other layouts take the slow path: the
        # same bits, a copy_ each.)
        self.groups = {d: g for g, d in enumerate(dict.fromkeys(t.dtype for t, k in zip(state, self.kinds)
                                                                if k != "spec"))}   # dtype -> group
        self._views: dict[tuple, list[list[torch.Tensor]]] = {}
        self.entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()   # LRU first
        self.root = hashlib.sha256(scope.encode()).digest()
        self.counters = collections.Counter()

    # ---- keys ----
    def keys(self, prompt: list[int], blocks: int, parent: bytes | None = None, first: int = 0) -> list[bytes]:
        """The chain keys of the prompt's blocks [first, blocks), block `first` extending `parent` (default:
        the scope, for first = 0): each key_k = sha256(key_{k-1} || block k's ids as int64)."""
        out, k = [], self.root if parent is None else parent
        ids = array.array("q", prompt[first * self.C:blocks * self.C]).tobytes()     # int64, native order
        step = self.C * 8
        for b in range(blocks - first):
            k = hashlib.sha256(k + ids[b * step:(b + 1) * step]).digest()
            out.append(k)
        return out

    # ---- a request's prefill ----
    def lookup(self, prompt: list[int], slot: int, chain: list[Entry]) -> int:
        """The longest cached prefix of whole blocks that ends on a GDN snapshot and leaves at least one prompt
        token to prefill (the last chunk samples the first token): its KV rows and GDN state are copied into
        `slot` -> P, its tokens; its entries are appended to `chain` (the request's, empty), pinned: release()
        it when the prefill ends. Blocks matched past the last snapshot are not used; the deepest is marked
        wanted, so this request's prefill snapshots it (the prompts that share it next hit there)."""
        blocks = (len(prompt) - 1) // self.C
        matched = []
        for key in self.keys(prompt, blocks):
            e = self.entries.get(key)
            if e is None:
                break
            matched.append(e)
        self.counters["queried_tokens"] += len(prompt)
        n = max((i + 1 for i, e in enumerate(matched) if e.state), default=0)
        if len(matched) > n:
            matched[-1].wanted = True
        chain.extend(matched[:n])
        if not chain:
            return 0
        for e in reversed(chain):                  # a parent stays more recent than its children
            e.pins += 1
            self.entries.move_to_end(e.key)
        P = n * self.C
        # block b's KV rows (chain[b]'s pool row) -> the slot's rows [bC, (b+1)C); the last entry's GDN state
        # (after token P - 1) -> the slot's
        self._copy([(self._slot_kv(slot, b), self._row_kv(e.row)) for b, e in enumerate(chain)]
                   + [(self._slot_gdn(slot), self._row_gdn(chain[-1].row))])
        self.counters["hit_tokens"] += P
        self.counters["hits"] += 1
        return P

    def store(self, prompt: list[int], done: int, slot: int, chain: list[Entry]) -> None:
        """After a prefill chunk that ended at `done` tokens (a multiple of C) in `slot`: store the block that
        ends there, unless it is cached already (then it is pinned), the chain before it is not (a block left
        unstored ends its prompt's chain), or no pool row is free or evictable. `chain`: the request's pinned
        entries, extended here.
        Every stored block copies its C KV rows; the GDN state (most of a block's bytes) is copied only where a
        later hit can end: the prompt's last two block boundaries (the same prompt again, or one that extends
        it: a next turn) and a block a lookup marked wanted (prompts diverge after it). So a prefill with
        nothing to share pays KV rows per block and one or two snapshots. Speculative: not the block that ends
        at the prompt's end (its last head row is made on the sampled id; module docstring)."""
        b = done // self.C - 1
        if done % self.C or len(chain) != b or (self.speculative and done == len(prompt)):
            return
        key = self.keys(prompt, b + 1, chain[-1].key if chain else None, b)[0]   # one block's hash
        e = self.entries.get(key)
        snap = b + 1 >= (len(prompt) - 1) // self.C
        if e is None:
            row = self._row()
            if row is None:
                self.counters["store_skipped"] += 1
                return
            parent = chain[-1] if chain else None
            e = self.entries[key] = Entry(key, parent, row, b + 1)
            if parent is not None:
                parent.children += 1
            self.counters["stored_blocks"] += 1
            kv = True
        else:
            self.entries.move_to_end(key)
            snap, kv = (snap or e.wanted) and not e.state, False
        if kv or snap:
            pairs = [(self._row_kv(e.row), self._slot_kv(slot, b))] if kv else []
            if snap:
                pairs.append((self._row_gdn(e.row), self._slot_gdn(slot)))
                e.state = True
                self.counters["state_snapshots"] += 1
            self._copy(pairs)
        e.pins += 1
        chain.append(e)

    def _copy(self, pairs: list) -> None:
        """dst <- src for each (dst, src) pair of view lists grouped by dtype: one torch._foreach_copy_ per
        dtype for all of them."""
        dst, src = [[] for _ in self.groups], [[] for _ in self.groups]
        for d, s in pairs:
            for g in range(len(self.groups)):
                dst[g] += d[g]
                src[g] += s[g]
        for d, s in zip(dst, src):
            if d:
                torch._foreach_copy_(d, s)

    def _grouped(self, key: tuple, views) -> list[list[torch.Tensor]]:
        """The views of `key`, made once from `views` (a callable -> [(state index, view)]), a list per dtype."""
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = [[] for _ in self.groups]
            for i, view in views():
                v[self.groups[self.state[i].dtype]].append(view)
        return v

    def _slot_kv(self, slot: int, b: int) -> list:
        """The slot's KV rows of block b: [C, D] per KV tensor [S+1, KVH, Tmax, D] and head."""
        C = self.C
        return self._grouped(("slot_kv", slot, b), lambda: [
            (i, self.state[i][slot, h, b * C:(b + 1) * C]) for i in self.kv for h in range(self.state[i].shape[1])])

    def _row_kv(self, row: int) -> list:
        """A pool row's KV rows, as _slot_kv's: [C, D] per KV pool [N, KVH, C, D] and head."""
        return self._grouped(("row_kv", row), lambda: [
            (i, self.pools[i][row, h]) for i in self.kv for h in range(self.pools[i].shape[1])])

    def _slot_gdn(self, slot: int) -> list:
        """The slot's GDN state: [Ch, W-1] per conv tensor, [HV, K, V] per recurrent one."""
        return self._grouped(("slot_gdn", slot), lambda: [(i, self.state[i][slot]) for i in self.gdn])

    def _row_gdn(self, row: int) -> list:
        return self._grouped(("row_gdn", row), lambda: [(i, self.pools[i][row]) for i in self.gdn])

    def release(self, chain: list[Entry]) -> None:
        """Unpin a request's chain (its prefill ended or it was cancelled)."""
        for e in chain:
            e.pins -= 1
        chain.clear()

    def _row(self) -> int | None:
        """A free pool row, evicting the least recently used unpinned leaf if none is free."""
        if self.free_rows:
            return self.free_rows.pop()
        victim = next((e for e in self.entries.values() if not e.pins and not e.children), None)
        if victim is None:
            return None
        del self.entries[victim.key]
        victim.state = victim.wanted = False     # (its row's next entry starts without a snapshot)
        if victim.parent is not None:
            victim.parent.children -= 1
        self.counters["evictions"] += 1
        return victim.row

    def stats(self) -> dict:
        """Prompt tokens queried and hit, entries, bytes held and evictions since the cache was made."""
        return {"block_tokens": self.C, "block_bytes": self.block_bytes, "capacity_blocks": self.capacity,
                "budget_bytes": self.capacity * self.block_bytes, "entries": len(self.entries),
                "bytes": len(self.entries) * self.block_bytes, "queried_tokens": self.counters["queried_tokens"],
                "hit_tokens": self.counters["hit_tokens"], "hits": self.counters["hits"],
                "stored_blocks": self.counters["stored_blocks"],
                "state_snapshots": self.counters["state_snapshots"], "store_skipped": self.counters["store_skipped"],
                "evictions": self.counters["evictions"]}


def budget(art, max_slots: int, requested: int | None, free_memory: int | None = None,
           chunk: int | None = None) -> int:
    """The pool bytes of an engine over `art` (an Artifact) with max_slots slots, checked before anything loads:
    `requested` bytes, or None for DEFAULT_FRACTION of the memory free after the weights, the slots and the
    workspace (runtime/memory.py; `free_memory`: the free bytes to assume), at most DEFAULT_PROMPTS prompts of
    max_seq_len tokens, and 0 where that default holds no block. A block is `chunk` tokens (the engine's
    prefill chunk; default the artifact's largest).
    A request that is negative, holds no block or is larger than that room, or a layout the cache does not hold
    (`unsupported`), is a ValueError of one line."""
    from .memory import DoesNotFit, free_bytes, needed_bytes, size
    why = unsupported(art.state, art.tp)
    if why:
        raise ValueError(why)
    if requested is not None and requested < 0:
        raise ValueError(f"the prefix cache budget must be >= 0 bytes, got {requested}")
    free = free_bytes(art.device) if free_memory is None else free_memory
    room = max(0, free - needed_bytes(art.path, art.manifest, max_slots, art.device.type, art.rank)["total"])
    C = chunk or max(g["bucket"] for g in art.graphs.values() if g["kind"] == "prefill")
    per = block_bytes(art.state, C)
    if requested is None:
        default = min(int(room * DEFAULT_FRACTION), DEFAULT_PROMPTS * -(-art.max_seq_len // C) * per)
        return default if default >= per else 0
    if requested < per:
        raise ValueError(f"a prefix cache of {requested} bytes holds no block ({per} bytes per block)")
    if requested > room:
        raise DoesNotFit(f"a prefix cache of {size(requested)} does not fit: {size(room)} is free on "
                         f"{art.device.type} after the weights, {max_slots} slots and the workspace")
    return requested


def for_executor(ex, budget_bytes: int) -> PrefixCache:
    """A cache over an artifact executor's state: blocks of its prefill chunk (GraphExecutor.max_chunk), scoped
    by the artifact's manifest hash (graphs, weights, dtype, options), its backend, device and that chunk (the
    chunk partition sets a prompt's rounding)."""
    art = ex.artifact
    scope = f"{art.manifest.get('manifest_sha256')}|{art.backend}|{ex.device}|chunk {ex.max_chunk}"
    return PrefixCache(ex.state, art.state, ex.max_chunk, budget_bytes, scope)
