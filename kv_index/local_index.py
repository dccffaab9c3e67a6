"""The router's in-memory copy of the KV-block index: the same (block, node) -> tier mask entries
the durable copy in Redis holds (kv_index/schema.py), answering ``match`` in-process, with no
round trip and no lock on the read path. kv_index/event_feed.py keeps it equal to Redis from
the stream of event batches the index's scripts append to (``{ns}:kvevents``).

Plain data, no Redis: the feed (one thread) is its only writer; request threads only read.

    block hash -> (Holders, Run, offset in the run), or (Holders, None, 0) outside any run
        Holders   the nodes holding the block and their tier masks; never changed once made
                  (interned: blocks with the same holders share one, and one entry tuple)
        Run       consecutive blocks of a chain held by the same nodes (the masks may change
                  along it: its segments say where)
    node id -> {hash: mask}     the writer's own bookkeeping (removal, resync)

Why no lock: a writer never mutates what a reader may hold. It builds a new entry and stores
it under the block's hash (copy on write), and kills a run (``live = False``) before it changes
any of its blocks; one dict store or ``get`` is atomic. So a lookup sees, block by block, the
holders before or after each write, never half of one. It may see part of a batch the writer is
applying: that is staleness, and staleness of this copy, like any staleness of the index, costs
a cache miss (or a predicted hit that turns out shorter), never a wrong answer: the index is a
hint, and the prefill node verifies the tokens of every cached block before it reuses it
(docs/cluster.md).

Why runs: a dict probe per block is a cache miss per block on a large index, and that, not the
Python around it, bounds a 64-block lookup. A run lets one probe stand for the blocks after it:
the lookup compares the prompt's next hashes with the run's (one C-level list comparison,
sequential memory) and, while the run is live, all of them have the run's holders. Runs come
from the order blocks are stored in (a store group of one batch lists a chain's new blocks in
chain order) and, for blocks resynced from the durable copy (a snapshot has no order), from the
prompts looked up (``hints``, replayed by the writer). A run is a shortcut, never the answer:
without one the lookup probes every block and answers the same.
"""
from __future__ import annotations

import itertools
import operator
import struct
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from kv_index.nodes import PrefixMatch

NO_MATCH = PrefixMatch(0)
_DEVICE, _HOST = 1, 2  # schema.tier_bit(TIER_DEVICE), tier_bit(TIER_HOST)
MIN_RUN = 4  # shorter runs save less than their bookkeeping costs
HINTS = 1024  # prompts kept for the writer to learn runs from (the oldest dropped)

# One group of an event batch: ("+" store | "-" remove, tier, hashes).
Group = tuple[str, int, list[int]]


def parse_groups(data: bytes) -> list[Group]:
    """The groups of a stream entry's ``e`` field, as ``scripts.APPLY_EVENTS`` writes it: per
    group its op ("+" or "-"), its tier (one digit), a 4-byte big-endian count and that many
    8-byte big-endian hashes (``encode_groups``). ValueError if malformed."""
    out: list[Group] = []
    i, end = 0, len(data)
    while i < end:
        if i + 6 > end:
            raise ValueError(f"malformed event group at byte {i}: truncated header")
        op, tier, n = chr(data[i]), data[i + 1] - 48, int.from_bytes(data[i + 2:i + 6], "big")
        j = i + 6 + 8 * n
        if op not in ("+", "-") or not 0 <= tier < 8 or j > end:
            raise ValueError(f"malformed event group at byte {i}: {data[i:i + 6]!r}")
        out.append((op, tier, list(struct.unpack(f">{n}Q", data[i + 6:j]))))
        i = j
    return out


def encode_groups(groups: Iterable[Group]) -> bytes:
    """``parse_groups``'s input for ``groups`` (what the script appends; tests build events)."""
    return b"".join(op.encode() + str(tier).encode() + len(hs).to_bytes(4, "big") + struct.pack(f">{len(hs)}Q", *hs)
                    for op, tier, hs in groups)


class Holders:
    """The nodes holding one block and the tiers they hold it in; never changed once made."""

    __slots__ = ("masks", "ids", "host", "disk", "lower", "bare")

    def __init__(self, masks: dict[str, int], ids: frozenset[str]) -> None:
        self.masks = masks  # node id -> tier mask
        self.ids = ids  # its nodes (interned: holders of the same nodes share it)
        # Held in host memory and not on the device; on disk only (the lookup's tier counts).
        self.host = frozenset(n for n, m in masks.items() if not m & _DEVICE and m & _HOST)
        self.disk = frozenset(n for n, m in masks.items() if not m & (_DEVICE | _HOST))
        self.lower = bool(self.host or self.disk)
        self.bare = (self, None, 0)  # the entry of its blocks outside any run, one for all


class Run:
    """Consecutive blocks of a chain, in order, held by the nodes ``ids`` while ``live``;
    ``segments``: (start, end, Holders) of the stretches whose masks are the same."""

    __slots__ = ("hashes", "ids", "segments", "lower", "live")

    def __init__(self, hashes: list[int], segments: list[tuple[int, int, Holders]]) -> None:
        self.hashes = hashes
        self.ids = segments[0][2].ids
        self.segments = segments
        self.lower = any(h.lower for _, _, h in segments)
        self.live = True


class LocalIndex:
    """Block hash -> ``Holders``, with a lookup that walks a prompt's chained hashes."""

    def __init__(self) -> None:
        self._blocks: dict[int, tuple[Holders, Run | None, int]] = {}
        self._held: dict[str, dict[int, int]] = {}  # writer side only
        self._seq: dict[str, int] = {}  # last event batch applied per node (-1: none known)
        self._canon: dict[frozenset, Holders] = {}  # interned holders (writer side)
        self._ids: dict[frozenset, frozenset] = {}  # interned node sets
        self.hints: deque[tuple[int, ...]] = deque(maxlen=HINTS)  # readers append, the writer drains

    # ------------------------------------------------------------------ the read path
    def match(self, block_hashes: Sequence[int], node_ids: Sequence[str]) -> dict[str, PrefixMatch]:
        """``IndexReader.match``'s answer from memory: per id, the leading blocks of
        ``block_hashes`` it holds in any tier, each counted in its fastest tier (every id in
        the result, ``PrefixMatch(0)``: none). Lock-free; see the module docstring."""
        out = dict.fromkeys(node_ids, NO_MATCH)
        n = len(block_hashes)
        if not n or not out:
            return out
        if not isinstance(block_hashes, list):
            block_hashes = list(block_hashes)  # compared with runs' lists
        get = self._blocks.get
        alive = out.keys()  # the candidates holding every block so far (set-like)
        host: dict[str, int] = {}  # node -> of its matched blocks, those in host memory only
        disk: dict[str, int] = {}  # ... and those on disk only
        at = probed = 0
        prev = None  # the node set of the last block
        while at < n:
            e = get(block_hashes[at])
            if e is None:
                break
            holders, run, off = e
            ids = holders.ids
            if ids is not prev:
                if not ids >= alive:
                    if at:
                        _finish(out, alive - ids, at, host, disk)
                    alive = ids & alive
                    if not alive:
                        return out
                prev = ids
            if run is not None and run.live:
                hs = run.hashes
                k = len(hs) - off
                if k > n - at:
                    k = n - at
                # Most runs are walked whole: one list comparison, no slice of the run's list.
                if not (block_hashes[at:at + k] == (hs if off == 0 and k == len(hs) else hs[off:off + k])):
                    k = _common(block_hashes, at, hs, off, k)
                if run.lower:
                    _tally_run(run, off, off + k, alive, host, disk)
            else:  # no run: the blocks after it with the same entry, counted in C
                k = 1
                for f, same in itertools.groupby(map(get, itertools.islice(block_hashes, at + 1, n))):
                    if f is e:
                        k += len(list(same))
                    break
                probed += k
                if holders.lower:
                    _tally(holders, k, alive, host, disk)
            at += k
        _finish(out, alive, at, host, disk)
        if probed >= MIN_RUN:  # the writer can make runs of these blocks
            self.hints.append(tuple(block_hashes[:at]))
        return out

    # ------------------------------------------------------------------ the writer's side
    def node_seq(self, node_id: str) -> int | None:
        """The last event batch applied for ``node_id`` (None: the node is not in the copy)."""
        return self._seq.get(node_id)

    def nodes(self) -> list[str]:
        return list(self._seq)

    def holdings(self, node_id: str) -> dict[int, int]:
        """hash -> tier mask of one node (a copy): what its entries in Redis should say."""
        return dict(self._held.get(node_id, {}))

    @property
    def entries(self) -> int:
        """(block, node) entries held."""
        return sum(len(h) for h in self._held.values())

    def apply(self, node_id: str, seq: int, cleared: bool, groups: Iterable[Group]) -> None:
        """One event batch as ``schema.APPLY_EVENTS`` applies it: ``cleared`` first, then each
        group in order, setting or clearing its tier's bit in each block's mask."""
        held = self._held.setdefault(node_id, {})
        if cleared:
            for h in list(held):
                self._set(node_id, held, h, 0)
        stored = []
        for op, tier, hashes in groups:
            bit = 1 << tier
            for h in hashes:
                m = held.get(h, 0)
                if op == "+":
                    if not m & bit:
                        self._set(node_id, held, h, m | bit)
                elif m & bit:
                    self._set(node_id, held, h, m & ~bit)
            if op == "+":
                stored.append(hashes)
        self._seq[node_id] = seq
        if stored:  # a store group lists a chain's blocks in chain order; the tiers' groups, a chain's parts
            self.learn(list(dict.fromkeys(itertools.chain.from_iterable(stored))))

    def replace_node(self, node_id: str, held: Mapping[int, int], seq: int) -> None:
        """Every entry of ``node_id`` replaced by ``held`` (hash -> mask), as ``RESYNC`` does."""
        mine = self._held.setdefault(node_id, {})
        for h in [h for h in mine if not held.get(h)]:
            self._set(node_id, mine, h, 0)
        for h, mask in held.items():
            if mask and mine.get(h) != mask:
                self._set(node_id, mine, h, mask)
        self._seq[node_id] = seq

    def drop_node(self, node_id: str) -> None:
        """Forget a node and its entries (its registry entry was pruned or it deregistered)."""
        held = self._held.get(node_id, {})
        for h in list(held):
            self._set(node_id, held, h, 0)
        self._held.pop(node_id, None)
        self._seq.pop(node_id, None)

    def learn(self, hashes: Sequence[int]) -> None:
        """Make runs of ``hashes`` (a chain, in order): each stretch of blocks held by the same
        nodes, in no live run yet, becomes one. A block already in a live run stays there (a
        chain branching off another shares the other's run as far as they agree), so runs
        never displace each other."""
        blocks = self._blocks
        i, n = 0, len(hashes)
        while i < n:
            e = blocks.get(hashes[i])
            if e is None:
                i += 1
                continue
            holders, run, off = e
            if run is not None and run.live:  # covered as far as the two chains agree
                i += _common(hashes, i, run.hashes, off, min(len(run.hashes) - off, n - i))
                continue
            ids, j = holders.ids, i + 1
            while j < n and (f := blocks.get(hashes[j])) is not None and f[0].ids is ids and not (
                    f[1] is not None and f[1].live):
                j += 1
            if j - i >= MIN_RUN:
                self._make_run(list(hashes[i:j]))
            i = j

    def _make_run(self, stretch: list[int]) -> None:
        blocks = self._blocks
        segments: list[list] = []  # [start, end, Holders]
        for h in stretch:
            holders = blocks[h][0]
            if segments and segments[-1][2] is holders:
                segments[-1][1] += 1
            else:
                end = segments[-1][1] if segments else 0
                segments.append([end, end + 1, holders])
        run = Run(stretch, [(s0, s1, x) for s0, s1, x in segments])
        for off, h in enumerate(stretch):
            blocks[h] = (blocks[h][0], run, off)

    def learn_hints(self) -> int:
        """Runs from the prompts lookups walked block by block; returns how many were read."""
        done = 0
        while self.hints:
            self.learn(self.hints.popleft())
            done += 1
        return done

    def _kill(self, run: Run) -> None:
        run.live = False  # first: a reader holding the run stops trusting it
        for h in run.hashes:
            e = self._blocks.get(h)
            if e is not None and e[1] is run:
                self._blocks[h] = e[0].bare

    def _set(self, node_id: str, held: dict[int, int], h: int, mask: int) -> None:
        if mask:
            held[h] = mask
        else:
            held.pop(h, None)
        old = self._blocks.get(h)
        if old is not None and old[1] is not None:
            self._kill(old[1])  # its blocks no longer all have its holders
        new = dict(old[0].masks) if old is not None else {}
        if mask:
            new[node_id] = mask
        else:
            new.pop(node_id, None)
        if new:
            self._blocks[h] = self._intern(new).bare  # one store: readers see old or new, whole
        else:
            self._blocks.pop(h, None)

    def _intern(self, masks: dict[str, int]) -> Holders:
        key = frozenset(masks.items())
        got = self._canon.get(key)
        if got is not None:
            return got
        if len(self._canon) > 2 * len(self._blocks) + 4096:
            # Holder sets no block uses any more: keep only the ones in use.
            live = {e[0] for e in self._blocks.values()}
            self._canon = {frozenset(x.masks.items()): x for x in live}
            self._ids = {x.ids: x.ids for x in live}
        ids = frozenset(masks)
        got = self._canon[key] = Holders(masks, self._ids.setdefault(ids, ids))
        return got


def _common(a: Sequence[int], i: int, b: Sequence[int], j: int, m: int) -> int:
    """Length of the common prefix of ``a[i:i+m]`` and ``b[j:j+m]`` (``m`` if they agree): the
    first difference found in C (``map`` of ``ne`` over both, ``compress`` of its index)."""
    ne = map(operator.ne, itertools.islice(a, i, i + m), itertools.islice(b, j, j + m))
    return next(itertools.compress(itertools.count(), ne), m)


def _tally(holders: Holders, k: int, alive, host: dict[str, int], disk: dict[str, int]) -> None:
    """``k`` blocks of ``holders`` matched by ``alive``: count those in a lower tier."""
    for x in holders.host & alive:
        host[x] = host.get(x, 0) + k
    for x in holders.disk & alive:
        disk[x] = disk.get(x, 0) + k


def _tally_run(run: Run, start: int, end: int, alive, host: dict[str, int], disk: dict[str, int]) -> None:
    """Blocks ``start:end`` of ``run`` matched by ``alive``: their lower tiers, by segment."""
    for s0, s1, holders in run.segments:
        if s1 <= start:
            continue
        if s0 >= end:
            break
        if holders.lower:
            _tally(holders, min(s1, end) - max(s0, start), alive, host, disk)


_PLAIN: dict[int, PrefixMatch] = {}  # blocks -> PrefixMatch(blocks): most answers, made once


def _finish(out: dict[str, PrefixMatch], nodes, blocks: int, host: dict[str, int], disk: dict[str, int]) -> None:
    """``nodes`` matched ``blocks`` leading blocks (``host``, ``disk``: of those, in a lower tier)."""
    if not blocks or not nodes:
        return
    plain = _PLAIN.get(blocks)
    if plain is None:
        plain = _PLAIN.setdefault(blocks, PrefixMatch(blocks))
    out.update(dict.fromkeys(nodes, plain))  # in C: most nodes end with device blocks only
    if host or disk:
        for x in nodes & (host.keys() | disk.keys()):
            out[x] = PrefixMatch(blocks, host.get(x, 0), disk.get(x, 0))
