"""CUDA attention through flashinfer's paged prefill kernel.

``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True`` aligns each sequence's queries to the
end of its KV (query i of a sequence with q_len n and kv_len m sits at m - n + i), which is
exactly the rule in ``metadata.py``; so one wrapper serves whole prefills, chunks, decodes and
speculative verification in one call per layer.

flashinfer is imported inside the class: it has no CPU path and is an optional extra (``gpu``),
so importing this module must work on machines without it.
"""
from __future__ import annotations

import torch

from engine.attention.backend import slot_rows, write_kv
from engine.attention.metadata import AttentionMetadata

_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferBackend:
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        import flashinfer

        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.scale = head_dim**-0.5
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # NHD: kv_cache[layer] is [num_pages, 2, page_size, H_kv, D], the layout of kv_cache.py.
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._k_rows: torch.Tensor | None = None

    def begin_step(self, meta: AttentionMetadata) -> None:
        bs = meta.block_size
        device = meta.block_tables.device
        # The page table in CSR form: sequence s owns pages indices[indptr[s]:indptr[s+1]],
        # the last of them filled to last_page_len[s]. Built from the host copies, so planning
        # needs no device-to-host sync.
        pages = [(n + bs - 1) // bs for n in meta.seq_lens]
        kv_indptr = [0]
        for p in pages:
            kv_indptr.append(kv_indptr[-1] + p)
        last_len = [n - (p - 1) * bs for n, p in zip(meta.seq_lens, pages)]
        width = meta.block_tables.shape[1]
        cols = torch.arange(width, device=device)
        used = cols[None, :] < torch.tensor(pages, device=device)[:, None]  # [S, W]
        kv_indices = meta.block_tables[used].to(torch.int32)  # row-major: per sequence, in order
        self._wrapper.plan(
            torch.tensor(meta.query_start, dtype=torch.int32),
            torch.tensor(kv_indptr, dtype=torch.int32),
            kv_indices,
            torch.tensor(last_len, dtype=torch.int32),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            bs,
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        self._k_rows = slot_rows(meta.slot_mapping, bs)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H_q, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        kv_cache_layer: torch.Tensor,  # [N, 2, bs, H_kv, D]
    ) -> torch.Tensor:  # [T, H_q, D]
        assert self._k_rows is not None, "begin_step() first"
        write_kv(kv_cache_layer, k, v, self._k_rows)
        return self._wrapper.run(q.contiguous(), kv_cache_layer)
