"""Drafting with a causal LM over a paged KV cache: a separate draft model, or the target's own
first layers (early exit), or a lower-precision copy of the target.

The draft's KV is indexed by the *target's* block ids: the draft cache has as many blocks as the
target's, and a sequence's draft KV for position p lives in the same block id and offset as its
target KV. So the target's allocation, copy-on-write, rollback and preemption bookkeeping all
hold for the draft too, with no second block manager. What the drafter tracks is how far each
sequence's draft KV is valid::

    positions  | draft KV valid ...... | catch-up ...... | t | d1 .. d(k-1) |
               0                  valid             start(=num_computed_tokens)

Draft KV at a position is valid when the token the draft fed there is the sequence's token:
after a verification, positions below ``num_computed_tokens`` hold accepted tokens, i.e. what
the draft fed, so ``valid = min(written, num_computed_tokens)``; a preemption resets it to 0.
Prompt KV that arrived from a prefill node (disaggregated path) or from a prefix-cache hit has
no draft KV: the first proposal catches up over it (a draft prefill on this node).

A drafter that *shares* the target's KV (early exit: layers 0..L-1 of the target compute
exactly what the target's own first L layers compute) never catches up: the target's KV for
those layers is valid for every computed position.
"""
from __future__ import annotations

import torch

from engine.attention import get_attention_backend
from engine.attention.kv_cache import allocate_kv_cache, copy_blocks
from engine.attention.metadata import AttentionMetadata
from engine.device import torch_dtype
from engine.model_runner import seeded_generator
from engine.models.loader import load_model
from engine.sampler import SamplingRow, processed_probs
from engine.speculative.proposer import DraftRequest, Proposal
from engine.speculative.rejection_sampler import sample_inverse_cdf


class ModelDrafter:
    batched = True  # one drafting round covers every sequence of the step
    target_states = None  # it runs a model of its own (or the target's first layers)
    def __init__(
        self,
        model,  # LlamaForCausalLM
        kv_cache: torch.Tensor,  # [L, num_blocks, 2, bs, H_kv, D], same num_blocks as the target
        block_size: int,
        device: torch.device,
        draft_cost: float,
        num_layers: int | None = None,  # None: all of the model's layers
        shares_target_kv: bool = False,
        eos_token_ids: tuple[int, ...] = (),
        seed: int = 0,
    ) -> None:
        cfg = model.cfg
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.draft_cost = draft_cost
        self.num_layers = num_layers
        self.shares_target_kv = shares_target_kv
        self.eos_token_ids = eos_token_ids
        self.backend = get_attention_backend(device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv_cache.dtype)
        self._gen = torch.Generator(device=device).manual_seed(seed + 1)
        # seq id -> (num_preemptions when written, positions [0, n) written by the draft)
        self._written: dict[str, tuple[int, int]] = {}

    # ---- Proposer
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        # Also for a shared cache: the runner copies only when the target runs, after drafting,
        # and the drafter must read the copied prefix (copying twice is harmless).
        copy_blocks(self.kv_cache, pairs)

    def forget(self, seq_id: str) -> None:
        self._written.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        # Round 0 feeds each sequence's catch-up span plus its last token; round j >= 1 feeds
        # draft j. Every round is one batched forward over the sequences still drafting.
        feeds = [self._catch_up(r) for r in requests]  # (first position, tokens)
        for j in range(max(r.k for r in requests)):
            active = [i for i, r in enumerate(requests) if r.k > j]
            if j > 0:
                feeds = [None] * len(requests)
                for i in active:
                    seq = requests[i].seq
                    feeds[i] = (seq.num_tokens - 1 + j, [drafts[i][-1]])
            logits = self._forward([(requests[i], *feeds[i]) for i in active])  # [len(active), V]
            self._sample(requests, active, logits, drafts, probs)
        for r in requests:
            self._written[r.seq.seq_id] = (r.seq.num_preemptions, r.seq.num_tokens - 1 + r.k)
        return [Proposal(d, None if not p else torch.stack(p)) for d, p in zip(drafts, probs)]

    # ---- internals
    def _catch_up(self, r: DraftRequest) -> tuple[int, list[int]]:
        seq = r.seq
        start = seq.num_tokens - 1  # the last token's position (== num_computed_tokens)
        if self.shares_target_kv:
            valid = start
        else:
            pre, written = self._written.get(seq.seq_id, (seq.num_preemptions, 0))
            valid = min(written, seq.num_computed_tokens) if pre == seq.num_preemptions else 0
        return valid, seq.token_ids[valid:]

    def _forward(self, feeds: list[tuple[DraftRequest, int, list[int]]]) -> torch.Tensor:  # [S, V]
        ids: list[int] = []
        pos: list[int] = []
        q_lens, seq_lens, tables, last_rows = [], [], [], []
        for r, first, toks in feeds:
            ids.extend(toks)
            pos.extend(range(first, first + len(toks)))
            q_lens.append(len(toks))
            seq_lens.append(first + len(toks))
            tables.append(r.block_table)
            last_rows.append(len(ids) - 1)
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, self.block_size, self.device)
        self.backend.begin_step(meta)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
        pos_t = torch.tensor(pos, dtype=torch.long, device=self.device)  # [T]
        hidden = self.model(ids_t, pos_t, self.kv_cache, self.backend, num_layers=self.num_layers)  # [T, H]
        rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))  # [S, V] fp32

    def _sample(self, requests, active, logits, drafts, probs) -> None:
        """Greedy requests take the draft's argmax (q one-hot: no probs kept); the others draw
        from the draft's distribution under the request's own sampling parameters."""
        rows = []
        for i in active:
            seq = requests[i].seq
            # The prompt only matters to the repetition penalty: don't copy it every round.
            prompt = seq.prompt_token_ids if seq.params.repetition_penalty != 1.0 else ()
            rows.append(SamplingRow(params=seq.params, prompt_token_ids=prompt,
                                    output_token_ids=seq.output_token_ids + drafts[i]))
        q = processed_probs(logits, rows, self.eos_token_ids)  # [S, V]
        for row, i in enumerate(active):
            seq = requests[i].seq
            if seq.params.greedy:
                drafts[i].append(int(q[row].argmax()))
                continue
            u = float(torch.rand((), generator=self._generator(seq, len(drafts[i])), device=self.device))
            drafts[i].append(sample_inverse_cdf(q[row], u))
            probs[i].append(q[row])

    def _generator(self, seq, j: int) -> torch.Generator:
        if seq.params.seed is None:
            return self._gen
        # Seeded requests draft deterministically too: (seed, sample, output step, draft slot).
        return seeded_generator(self.device, seq.params.seed, seq.index, seq.num_output_tokens, j,
                                person=b"pdserve-draft")


def check_vocab(draft_vocab: int, target_vocab: int) -> None:
    if draft_vocab != target_vocab:
        raise ValueError(f"the draft's vocabulary ({draft_vocab}) differs from the target's ({target_vocab}): "
                         "a draft model must share the target's tokenizer")


def param_ratio(draft, target) -> float:
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return n(draft) / n(target)


def own_kv_drafter(engine, loaded, dtype_name: str, draft_cost: float) -> ModelDrafter:
    """A drafter with its own weights and its own paged KV (same block ids as the target)."""
    check_vocab(loaded.config.vocab_size, engine.model_config.vocab_size)
    kv = allocate_kv_cache(loaded.config, engine.num_blocks, engine.block_size, torch_dtype(dtype_name), engine.device)
    return ModelDrafter(loaded.model, kv, engine.block_size, engine.device, draft_cost,
                        eos_token_ids=engine.eos_token_ids, seed=engine.config.seed)


def from_engine(engine) -> ModelDrafter:
    """A separate draft model (any causal LM with the target's tokenizer), loaded like the target."""
    cfg = engine.config.speculative
    if not cfg.draft_model:
        raise ValueError("speculative method 'draft' needs draft_model (a model dir or builtin name)")
    loaded = load_model(cfg.draft_model, torch_dtype(cfg.draft_dtype), engine.device)
    return own_kv_drafter(engine, loaded, cfg.draft_dtype, param_ratio(loaded.model, engine.loaded.model))
