"""The engine's KV tiers and prefix export / import: the part of ``LLMEngine`` that moves KV
between the device pool, the host and disk tiers (engine/kv_tiers/) and peers.

``TieredKV`` is a base of ``LLMEngine`` (engine/engine.py); it uses the engine's ``kv``
(KVCacheManager), ``tiers`` (KVTiers or None), ``runner``, ``device``, ``block_size`` and
``_requests``. Every method runs on the engine's thread (node/engine_thread.py submits them as
commands between steps).
"""
from __future__ import annotations

import time
from typing import Callable
from typing import Sequence as Seq

import torch

from engine.errors import InvalidRequestError
from engine.kv_tiers.build import TierCopies, build_tiers
from engine.kv_tiers.tiers import KVTiers
from engine.sequence import seq_id_of
from kv_index.events import TIER_HOST


class TieredKV:
    tiers: KVTiers | None = None

    def _build_tiers(self, cache_config, num_blocks: int, progress) -> TierCopies | None:
        """The tiers ``cache_config`` asks for over ``self.kv_cache`` (``self.tiers``);
        returns their tensors for the model runner (None without tiers)."""
        built = build_tiers(cache_config, self.kv_cache, self.fingerprint, num_blocks)
        if built is None:
            return None
        self.tiers, copies = built
        if progress:
            disk = self.tiers.disk
            progress(f"KV tiers: host {self.tiers.host.num_slots} blocks"
                     + (f", disk {disk.budget_bytes // disk.file_bytes} blocks in {disk.directory}" if disk else ""))
        return copies

    def _start_tiers(self) -> None:
        """Once ``self.kv`` exists: register the disk tier's blocks from an earlier life
        (BlockStored events with tier disk, published when the node starts)."""
        if self.tiers is not None:
            self.tiers.warm_start()

    def service_tiers(self) -> None:
        """Take the tiers' finished copies and file writes, start the queued ones (cheap; the
        engine calls it around every step, an idle engine loop when a tier worker wakes it)."""
        if self.tiers is not None:
            self.tiers.service()

    def set_tiers_notifier(self, fn: Callable[[], None] | None) -> None:
        """``fn`` is called from a tier worker thread whenever a copy or file write finished
        (it must only wake whoever calls ``service_tiers``)."""
        if self.tiers is not None:
            self.tiers.set_notifier(fn)

    @property
    def tiers_busy(self) -> bool:
        """The tiers have work in flight that ``service_tiers`` must come back for."""
        return self.tiers is not None and self.tiers.busy

    def _swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        t0 = time.perf_counter()
        self.runner.swap_in(pairs)
        self.tiers.stats[TIER_HOST].onboard_seconds.observe(time.perf_counter() - t0)

    def _swap_in_now(self) -> None:
        """Apply pending swap-ins at once (a command between steps: reserve, export)."""
        pairs = self.kv.take_swap_ins()
        try:
            self._swap_in(pairs)
            if pairs and self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        finally:
            self.kv.finish_swap_ins()

    def held_prefix(self, block_hashes: Seq[int], token_ids: Seq[int], cache_salt: bytes = b"") -> list[int]:
        """Where this engine holds the leading blocks of a prompt: for chained ``block_hashes``
        and their ``token_ids`` (block i = ``token_ids[i * block_size:(i + 1) * block_size]``),
        the tier of each leading block held (kv_index.events TIER_DEVICE / TIER_HOST /
        TIER_DISK), up to the first block held nowhere or whose hash is not this engine's (another
        model, or another cache salt: ``cache_salt`` is the chain's). Mutates nothing (no LRU
        change, no disk read); engine thread."""
        return self.kv.held_tiers(token_ids, block_hashes, cache_salt)

    def export_prefix(self, export_id: str, block_hashes: Seq[int], token_ids: Seq[int],
                      cache_salt: bytes = b"") -> list[int]:
        """Hold the leading blocks of a prompt in the device pool for a send to a peer; returns
        their block ids in ``kv_cache`` (possibly fewer than asked: what is held here, and fits).

        Device blocks take a reference; host and disk blocks are first brought into fresh device
        blocks (copied now, checksummed when read from disk) and registered as cached. Every block
        stays referenced under ``export_id`` until ``release_export(export_id)``, so any transport
        can send from the pool tensor and these ids. Hashes and token ids are verified as in
        ``held_prefix``. Mutates the pool and the tiers' LRU; engine thread."""
        n = len(self.kv.held_tiers(token_ids, block_hashes, cache_salt))
        pin_id = f"export:{export_id}"
        tokens = [int(t) for t in token_ids[: n * self.block_size]]
        hit = self.kv.pin_prefix(pin_id, tokens, n, cache_salt)
        self._swap_in_now()
        if not hit.num_tokens:
            return []
        if hit.lower:  # now device blocks like the others: later lookups hit them here
            self.kv.cache_computed_blocks(pin_id, tokens, hit.num_tokens, cache_salt)
        return self.kv.get_block_table(pin_id)

    def release_export(self, export_id: str) -> None:
        """Drop the references ``export_prefix(export_id)`` took (the blocks stay cached);
        idempotent."""
        self.kv.free(f"export:{export_id}")

    def commit_kv(self, request_id: str, prompt_token_ids: Seq[int], cache_salt: bytes = b"") -> int:
        """Import: the KV of ``prompt_token_ids`` arrived in the blocks ``reserve_kv(request_id)``
        reserved; register its full blocks as cached (chained hashes of these tokens) and release
        the reservation, so a later prefix lookup hits them. Returns the tokens now cached. Only
        call it once every reserved block past the reported cached prefix holds received,
        validated KV. ``cache_salt``: the chain's, as given to ``reserve_kv``. Engine thread."""
        seq_id = seq_id_of(request_id, 0)
        if not self.kv.has_seq(seq_id) or request_id in self._requests:
            raise InvalidRequestError(f"no KV reserved for request {request_id!r}")
        tokens = [int(t) for t in prompt_token_ids]
        full = len(tokens) // self.block_size * self.block_size
        self.kv.cache_computed_blocks(seq_id, tokens, full, cache_salt)
        self.kv.free(seq_id)
        return full

    def close(self) -> None:
        """Finish the tiers' queued copies and file writes and release the disk directory
        (a restarted engine in this process may then open it)."""
        if self.tiers is not None:
            self.tiers.close()
