"""Making an engine's tiers from its ``CacheConfig``: the host buffer, the disk directory, the
coordinator wired to the device pool's tensor."""
from __future__ import annotations

import torch

from engine.kv_tiers.block_file import KVLayout
from engine.kv_tiers.disk import DiskTier
from engine.kv_tiers.host import HostTier
from engine.kv_tiers.mover import HostBuffer, copy_in, copy_out, ready_event
from engine.kv_tiers.tiers import KVTiers


def element_size_of(dtype_name: str) -> int | None:
    """Bytes per element of a torch dtype named without its prefix; None if torch has none."""
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        return None
    return torch.empty((), dtype=dtype).element_size()


def kv_layout(kv_cache: torch.Tensor, fingerprint: str) -> KVLayout:
    """The layout of the device pool ``kv_cache`` ([L, N, 2, bs, H_kv, D]) of one model."""
    layers, _, _, block_size, heads, head_dim = kv_cache.shape
    return KVLayout(fingerprint, block_size, layers, heads, head_dim, str(kv_cache.dtype).removeprefix("torch."),
                    kv_cache.element_size())


class TierCopies:
    """The tensor side of one engine's tiers: its pool, its host buffer and the copies."""

    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        self.pool = kv_cache
        self.device = kv_cache.device
        block_shape = (kv_cache.shape[0], *kv_cache.shape[2:])  # [L, 2, bs, H_kv, D]
        self.host = HostBuffer(num_slots, block_shape, kv_cache.dtype, pin=self.device.type == "cuda")
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def copy_out(self, pairs, ready) -> None:
        copy_out(self.pool, self.host.tensor, pairs, ready, self.stream)

    def copy_in(self, pairs) -> None:
        copy_in(self.pool, self.host.tensor, pairs)

    def ready_event(self):
        return ready_event(self.device)


def build_tiers(cache_config, kv_cache: torch.Tensor, fingerprint: str, num_blocks: int
                ) -> tuple[KVTiers, TierCopies] | None:
    """The tiers ``cache_config`` asks for over the pool ``kv_cache`` (None: no host tier).
    The disk tier is scanned later (``KVTiers.warm_start``), once the pool takes its events."""
    if not cache_config.host_cache_mib or not cache_config.enable_prefix_caching:
        return None
    layout = kv_layout(kv_cache, fingerprint)
    num_slots = int(cache_config.host_cache_mib * 2**20) // layout.block_bytes
    if num_slots < 1:
        raise ValueError(f"host_cache_mib={cache_config.host_cache_mib} holds no block of this model "
                         f"({layout.block_bytes} bytes each)")
    copies = TierCopies(kv_cache, num_slots)
    disk = None
    if cache_config.disk_cache_dir:
        disk = DiskTier(cache_config.disk_cache_dir, int(cache_config.disk_cache_mib * 2**20), layout, element_size_of)
    tiers = KVTiers(HostTier(num_slots), disk, layout.block_bytes, copies.copy_out, copies.host.slot_view,
                    copies.ready_event, max_inflight=max(1, num_blocks // 8))
    return tiers, copies
