"""CPU reference attention over the paged KV cache, built on ``F.scaled_dot_product_attention``.

A step's sequences split into two groups by query length:

* short queries (decode, speculative verification; q_len <= ``short_q_max``) run in padded
  batches: one gather of their KV rows into ``[B, max_kv, H_kv, D]`` and one SDPA call with a
  boolean mask (causal offset + padding) per batch. Every sequence of a batch is padded to its
  longest query and KV, so ``split_short`` chooses the batches by what padding costs: a step
  where one sequence verifies 12 drafts beside 7 decodes would otherwise attend 13 query rows
  for all 8 (3x the attention of the decodes alone, measured);
* long queries (prefill chunks) run one sequence at a time, so no token pays for another
  sequence's padding; a chunk with no cached context uses SDPA's own causal path;
* with a native ``decode_kernel`` (bf16 models, ``cpu_decode.py``), decodes (q_len 1) skip both:
  the kernel reads their K and V where they lie in the paged cache, with no gather and no padding.

Gather indices and masks depend only on the metadata, so ``begin_step`` builds them once and all
layers reuse them. GQA is handled by folding the query heads that share a KV head into the query
length axis (``[B, H_kv, Q * G, D]``), which reads each KV head once instead of repeating it G times.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import flat_layer, slot_rows, write_kv
from engine.attention.cpu_decode import DecodeKernel
from engine.attention.metadata import AttentionMetadata

# What one more query row of a padded batch costs per KV position, relative to a decode's
# one row: the gather is paid once per position, the scores and the mask per row (fit over
# B 1-8, q_len 1-13, KV 128-512 on CPU; docs/benchmarks.md, "Figures behind constants").
QUERY_WEIGHT = 0.17


@dataclass(slots=True)
class _ShortBatch:
    tokens: torch.Tensor  # [B, Q] int64, flat token index of each (seq, query) cell; pad -> 0
    valid: torch.Tensor  # [B, Q] bool, cell holds a real token
    valid_tokens: torch.Tensor  # [n_valid] int64, tokens[valid]
    kv_rows: torch.Tensor  # [2 * B * max_kv] int64, K rows then V rows of every position; pad -> 0
    mask: torch.Tensor  # [B, 1, Q * G, max_kv] bool, True = attend
    max_kv: int


@dataclass(slots=True)
class _Decodes:
    """The step's decodes for the native kernel."""

    tables: torch.Tensor  # [n, W] int32, each decode's block table
    seq_lens: torch.Tensor  # [n] int32
    q_start: torch.Tensor  # [n] int32, each decode's token


@dataclass(slots=True)
class _LongSeq:
    start: int  # first token in the flat token axis
    q_len: int
    kv_rows: torch.Tensor  # [2 * seq_len] int64, K rows then V rows of positions 0 .. seq_len - 1
    mask: torch.Tensor | None  # [q_len * G, seq_len] bool, folded; None = plain causal (no context)


class TorchRefBackend:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, short_q_max: int = 16,
                 group_cost_cells: int = 1024, query_weight: float = QUERY_WEIGHT,
                 decode_kernel: DecodeKernel | None = None):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.short_q_max = short_q_max
        # What one more padded batch costs (per-call overhead of the gather and SDPA), in
        # padded KV positions: a call's fixed cost is worth about a thousand positions on CPU
        # (docs/benchmarks.md, "Figures behind constants").
        self.group_cost_cells = group_cost_cells
        self.query_weight = query_weight
        self.decode_kernel = decode_kernel
        self._decodes: _Decodes | None = None
        self._meta: AttentionMetadata | None = None
        self._k_rows: torch.Tensor | None = None
        self._shorts: list[_ShortBatch] = []
        self._long: list[_LongSeq] = []

    # ------------------------------------------------------------------ per step

    def begin_step(self, meta: AttentionMetadata) -> None:
        bs = meta.block_size
        device = meta.slot_mapping.device
        self._meta = meta
        self._k_rows = slot_rows(meta.slot_mapping, bs)
        starts = meta.query_start
        short = [s for s, q in enumerate(meta.q_lens) if q <= self.short_q_max]
        self._decodes = None
        if self.decode_kernel is not None:
            dec = [s for s in short if meta.q_lens[s] == 1]
            short = [s for s in short if meta.q_lens[s] != 1]
            if dec:
                self._decodes = _Decodes(
                    tables=meta.block_tables[torch.tensor(dec, device=device)].contiguous(),
                    seq_lens=torch.tensor([meta.seq_lens[s] for s in dec], dtype=torch.int32),
                    q_start=torch.tensor([starts[s] for s in dec], dtype=torch.int32),
                )
        self._shorts = [self._build_short(meta, group, starts, device)
                        for group in split_short(short, meta.seq_lens, meta.q_lens, self.group_cost_cells,
                                                 self.query_weight)]
        self._long = []
        for s, q in enumerate(meta.q_lens):
            if q <= self.short_q_max:
                continue
            seq_len = meta.seq_lens[s]
            ctx = seq_len - q
            pos = torch.arange(seq_len, device=device)
            rows = self._rows(meta.block_tables[s].long()[pos // bs], pos, bs)
            mask = None
            if ctx > 0:
                # query i (absolute position ctx + i) sees kv positions <= ctx + i
                mask = pos[None, :] <= (ctx + torch.arange(q, device=device))[:, None]  # [q, S]
                # Folded like the queries: row i * G + g is query i, head g of its KV group.
                mask = mask[:, None, :].expand(q, self.group, seq_len).reshape(q * self.group, seq_len)
            self._long.append(_LongSeq(start=starts[s], q_len=q, kv_rows=torch.cat([rows, rows + bs]), mask=mask))

    @staticmethod
    def _rows(block_ids: torch.Tensor, pos: torch.Tensor, bs: int) -> torch.Tensor:
        return block_ids * (2 * bs) + pos % bs

    def _build_short(
        self, meta: AttentionMetadata, seqs: list[int], starts: list[int], device: torch.device
    ) -> _ShortBatch:
        bs = meta.block_size
        q_lens = torch.tensor([meta.q_lens[s] for s in seqs], device=device)  # [B]
        seq_lens = torch.tensor([meta.seq_lens[s] for s in seqs], device=device)  # [B]
        first = torch.tensor([starts[s] for s in seqs], device=device)  # [B]
        q_max = max(meta.q_lens[s] for s in seqs)  # from the host lists: no device sync
        max_kv = max(meta.seq_lens[s] for s in seqs)

        qi = torch.arange(q_max, device=device)  # [Q]
        valid = qi[None, :] < q_lens[:, None]  # [B, Q]
        tokens = torch.where(valid, first[:, None] + qi[None, :], 0)  # [B, Q]

        pos = torch.arange(max_kv, device=device)  # [K]
        tables = meta.block_tables[torch.tensor(seqs, device=device)].long()  # [B, W]
        block_ids = tables[:, pos // bs]  # [B, K]; past a row's length this is padding, masked
        in_seq = pos[None, :] < seq_lens[:, None]  # [B, K]
        rows = torch.where(in_seq, self._rows(block_ids, pos[None, :], bs), 0)  # [B, K]

        # Query i of a sequence sits at ctx + i and sees positions <= ctx + i. A pad query row
        # gets the same limit as the sequence's last real token, so it never has an empty
        # (NaN) softmax row; its output is dropped.
        ctx = seq_lens - q_lens  # [B]
        limit = ctx[:, None] + torch.minimum(qi[None, :], q_lens[:, None] - 1)  # [B, Q]
        mask = pos[None, None, :] <= limit[:, :, None]  # [B, Q, K]
        # Fold the G query heads sharing a KV head into the query axis: row (i, g) -> i * G + g.
        mask = mask[:, :, None, :].expand(-1, -1, self.group, -1).reshape(len(seqs), 1, q_max * self.group, max_kv)
        return _ShortBatch(
            tokens=tokens,
            valid=valid,
            valid_tokens=tokens[valid],
            kv_rows=torch.cat([rows.reshape(-1), rows.reshape(-1) + bs]),
            mask=mask,
            max_kv=max_kv,
        )

    # ------------------------------------------------------------------ per layer

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H_q, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        kv_cache_layer: torch.Tensor,  # [N, 2, bs, H_kv, D]
    ) -> torch.Tensor:  # [T, H_q, D]
        assert self._meta is not None and self._k_rows is not None, "begin_step() first"
        write_kv(kv_cache_layer, k, v, self._k_rows)
        flat = flat_layer(kv_cache_layer)  # [N * 2 * bs, H_kv, D]
        if self._decodes is None:
            out = torch.empty_like(q)
        else:
            d = self._decodes
            q = q.contiguous()
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # the kernel writes dense rows
            self.decode_kernel(q, flat, d.tables, d.seq_lens, d.q_start, self._meta.block_size, self.scale, out)
        for sb in self._shorts:
            self._attend_short(sb, q, flat, out)
        for seq in self._long:
            self._attend_long(q, flat, seq, out)
        return out

    def _attend_short(self, sb: _ShortBatch, q: torch.Tensor, flat: torch.Tensor, out: torch.Tensor) -> None:
        b, q_max = sb.tokens.shape
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        # One gather for K and V of every sequence: [2, B, K, Hkv, D] -> [B, Hkv, K, D] views.
        kv = flat.index_select(0, sb.kv_rows).view(2, b, sb.max_kv, hkv, d).transpose(2, 3)
        k, v = kv[0], kv[1]
        qb = q[sb.tokens.reshape(-1)].view(b, q_max, hkv, g, d)  # [B, Q, Hkv, G, D]
        qb = qb.permute(0, 2, 1, 3, 4).reshape(b, hkv, q_max * g, d)  # [B, Hkv, Q*G, D]
        o = F.scaled_dot_product_attention(qb, k.to(q.dtype), v.to(q.dtype), attn_mask=sb.mask, scale=self.scale)
        o = o.view(b, hkv, q_max, g, d).permute(0, 2, 1, 3, 4).reshape(b, q_max, hkv * g, d)  # [B, Q, Hq, D]
        out[sb.valid_tokens] = o[sb.valid]

    def _attend_long(self, q: torch.Tensor, flat: torch.Tensor, seq: _LongSeq, out: torch.Tensor) -> None:
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        n = seq.q_len
        kv = flat.index_select(0, seq.kv_rows).view(2, -1, hkv, d).transpose(1, 2)  # [2, Hkv, S, D]
        k, v = kv[0], kv[1]
        if seq.mask is None:
            # Causal from position 0: keep queries as [Hkv*G] heads so SDPA's causal path applies.
            o = F.scaled_dot_product_attention(
                q[seq.start : seq.start + n].transpose(0, 1)[None],  # [1, Hq, n, D]
                k[None].to(q.dtype),
                v[None].to(q.dtype),
                is_causal=True,
                scale=self.scale,
                enable_gqa=g > 1,
            )[0]  # [Hq, n, D]
            out[seq.start : seq.start + n] = o.transpose(0, 1)
            return
        qs = q[seq.start : seq.start + n].view(n, hkv, g, d).permute(1, 0, 2, 3)  # [Hkv, n, G, D]
        o = F.scaled_dot_product_attention(
            qs.reshape(hkv, n * g, d), k.to(q.dtype), v.to(q.dtype), attn_mask=seq.mask, scale=self.scale
        )  # [Hkv, n*G, D]
        out[seq.start : seq.start + n] = o.view(hkv, n, g, d).permute(1, 0, 2, 3).reshape(n, hkv * g, d)


def split_short(seqs: list[int], seq_lens: list[int], q_lens: list[int], group_cost: float,
                query_weight: float = QUERY_WEIGHT) -> list[list[int]]:
    """Partition short-query sequences into the padded batches that cost the least.

    A padded batch of ``size`` sequences costs ``size * longest * (1 + query_weight * (q_max -
    1))`` KV positions, plus ``group_cost`` for the call itself: every sequence attends with
    the batch's longest KV and its longest query. Sorted by length, the best partition into
    contiguous runs is found by a small DP::

        lengths  40 60 90 | 500 650 700     one batch: 6 * 700 = 4200 positions
                 group 1   | group 2         two: 3 * 90 + 3 * 700 + cost = 2370 + cost

    A verification (q_len k + 1) sits among decodes (q_len 1) of similar length, where no
    contiguous run separates it, so the same DP also runs on decodes and verifications apart
    and the cheaper of the two partitions wins.
    """
    merged, cost = _split_sorted(seqs, seq_lens, q_lens, group_cost, query_weight)
    one = [s for s in seqs if q_lens[s] == 1]
    if not one or len(one) == len(seqs):
        return merged
    many = [s for s in seqs if q_lens[s] > 1]
    g1, c1 = _split_sorted(one, seq_lens, q_lens, group_cost, query_weight)
    g2, c2 = _split_sorted(many, seq_lens, q_lens, group_cost, query_weight)
    return g1 + g2 if c1 + c2 < cost else merged


def _split_sorted(seqs: list[int], seq_lens: list[int], q_lens: list[int], group_cost: float,
                  query_weight: float) -> tuple[list[list[int]], float]:
    """The cheapest partition of ``seqs`` into runs contiguous by length, and its cost."""
    order = sorted(seqs, key=lambda s: seq_lens[s])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j sequences
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = seq_lens[order[j - 1]]
        q_max = 1
        for i in range(j - 1, -1, -1):  # group order[i:j], its longest query kept as i falls
            q_max = max(q_max, q_lens[order[i]])
            c = best[i] + (j - i) * longest * (1 + query_weight * (q_max - 1)) + group_cost
            if c < best[j]:
                best[j], cut[j] = c, i
    groups = []
    j = n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1], best[n]
