"""One engine's grammar state: a matcher per constrained sequence, advanced over every token the
sequence gets, wherever that token came from (docs/structured.md).

The matcher follows the sequence's tokens, not its KV: a preemption (recompute) leaves it as it
is, and the prefix cache and KV index never see it. The tokens it is advanced over::

    add              the output tokens the request arrives with: a migrated request's resumed
                     outputs (router/migration.py), then on a decode node the prefill node's
                     first token(s): so the continuation is the one the fault-free run makes
    prepare (step)   drafts checked token by token: the first one the grammar refuses ends the
                     draft; masks for every sampled and verified position; then rolled back
    fork             an n > 1 prompt's samples start as copies of the prompt's state
    advance          the tokens the step emitted (sampled, or accepted drafts + the next)

A grammar with nothing left to match but EOS ends its sequence (STOP): ``advance`` says so.

The step's masks are the serial part of constrained decoding; by default (``FillMode.OVERLAP``)
they are filled for the whole batch at once on llguidance's native pool while the forward
runs, and waited for where the logits are masked (a GPU step of a few ms would otherwise wait
for a fill that grows with the batch). Drafts are walked before the forward: a cut changes
what it computes.
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import llguidance
import torch

from engine.errors import InvalidRequestError
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence as Sequence_
from engine.sequence import seq_id_of
from engine.structured.compiler import LazyCompiler
from engine.structured.mask import StepMasks, bitmask_words
from tokens.grammar import GrammarError
from tokens.sampling_params import StructuredOutput
from tokens.stop import FinishReason

log = logging.getLogger(__name__)


def _allowed(rows: torch.Tensor, r: int, token: int) -> bool:
    return bool((int(rows[r, token // 32]) >> (token % 32)) & 1)


class FillMode(enum.Enum):
    """How a step's masks are filled; every mode fills exactly the same masks."""

    SERIAL = "serial"  # one matcher after another, on the engine thread, before the forward
    PARALLEL = "parallel"  # the batch at once on llguidance's native pool (off the GIL), before the forward
    OVERLAP = "overlap"  # PARALLEL, started before the forward and waited for where the logits are masked
    # (a step with one row to fill fills it at once: the thread hand-off costs about a mask)


class StructuredDecoding:
    def __init__(self, compiler: LazyCompiler, vocab_size: int, eos_token_ids: Sequence[int],
                 fill: FillMode = FillMode.OVERLAP, fill_threads: int | None = None) -> None:
        self.compiler = compiler
        self.words = bitmask_words(vocab_size)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.fill = fill  # may change between steps (the bench and the tests compare the modes)
        self.fill_threads = fill_threads  # llguidance's pool; None: its default (80% of the CPUs, up to 32)
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None  # built on the first parallel fill
        self._thread: ThreadPoolExecutor | None = None  # the overlapped fill's thread, built on first use
        self._pending: Future | None = None  # an overlapped fill not yet waited for

    @classmethod
    def for_engine(cls, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                   fill: FillMode = FillMode.OVERLAP) -> StructuredDecoding:
        """An engine's: masks as wide as its logits; its compiler built on the first
        constraint (an engine without a tokenizer refuses constraints then)."""
        return cls(LazyCompiler(hf_tokenizer, vocab_size, eos_token_ids), vocab_size, eos_token_ids, fill)

    @property
    def active(self) -> bool:
        return bool(self._matchers)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def compile(self, so: StructuredOutput | None) -> None:
        """Compile (or find cached) ``so`` now, on the caller's thread: a node compiles before
        the engine thread adds the request, so a slow compile never stalls a step."""
        if so is not None:
            try:
                self.compiler.get().compile(so)
            except GrammarError as e:
                raise InvalidRequestError(str(e)) from None

    def add(self, seq_id: str, so: StructuredOutput | None, output_token_ids: Sequence[int]) -> None:
        """Start ``seq_id``'s matcher and advance it over the outputs it already has;
        InvalidRequestError when the constraint is refused or refuses one of them."""
        if so is None:
            return
        try:
            m = self.compiler.get().matcher(so)
        except GrammarError as e:
            raise InvalidRequestError(str(e)) from None
        for i, tok in enumerate(output_token_ids):
            if tok in self.eos_token_ids and m.is_accepting():
                break
            if not m.consume_token(int(tok)):
                raise InvalidRequestError(f"output token {i} (id {tok}) the request arrived with does not match "
                                          f"its structured-output constraint ({so.kind})")
        self._matchers[seq_id] = m

    def ended(self, seq_id: str) -> bool:
        """Nothing but EOS can follow: the sequence is complete."""
        self._settle()
        m = self._matchers.get(seq_id)
        return m is not None and m.is_stopped()

    def fork(self, scheduled: list[ScheduledSeq]) -> None:
        """Before the step's tokens are appended: every n > 1 prompt that sampled its samples
        this step hands each new sample a copy of its (pre-sample) state."""
        self._settle()
        for item in scheduled:
            m = self._matchers.get(item.seq.seq_id)
            if m is not None and item.num_samples > 1:
                for k in range(1, item.num_samples):
                    self._matchers[seq_id_of(item.seq.request_id, k)] = m.deep_copy()

    def advance(self, seq_id: str, tokens: Sequence[int]) -> int | None:
        """Advance over a step's emitted tokens -> None while the grammar goes on, else how
        many of them belong to the output: up to and including an EOS it allowed, or up to the
        token that completed it (an EOS the verification emitted after that is not output:
        plain decoding ends there without sampling one). A refused token (never: every one was
        sampled under the mask) is logged, and the output ends before it."""
        self._settle()
        m = self._matchers.get(seq_id)
        if m is None:
            return None
        for i, tok in enumerate(tokens):
            if tok in self.eos_token_ids and m.is_accepting():
                return i + 1
            if not m.consume_token(int(tok)):
                log.error("structured output: %s emitted token %d that its grammar refuses: %s", seq_id, tok,
                          m.get_error())
                return i
            if m.is_stopped():
                return i + 1
        return None

    def follow(self, seq: Sequence_, new: list[int], scheduler: Scheduler) -> list[int]:
        """Advance a constrained sequence's grammar over the tokens its step emitted (``new``);
        once the grammar is complete the sequence is done (STOP) and released, and tokens a
        verification emitted past that point are cut from it -> the tokens that are output."""
        kept = self.advance(seq.seq_id, new)
        if kept is None:
            return new
        if kept < len(new):
            del seq.token_ids[len(seq.token_ids) - (len(new) - kept):]
            seq.finish_reason = FinishReason.STOP  # may have been finished by a later token
            new = new[:kept]
        if not seq.is_finished:
            scheduler.finish_and_release(seq, FinishReason.STOP)
        return new

    def forget(self, *seq_ids: str) -> None:
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepMasks | None:
        """Masks for every constrained sequence that samples or verifies this step. Drafts are
        walked now, in waves across the batch (``_walk_drafts``): the first token the grammar
        refuses ends a draft, which changes what the forward computes. The other rows are
        filled by ``self.fill``: now (SERIAL, PARALLEL), or started now and waited for where
        the logits are masked (OVERLAP: ``StepMasks.apply`` waits)."""
        self._settle()
        jobs = [it for it in scheduled if it.sample and it.seq.seq_id in self._matchers]
        if not jobs:
            return None
        total = sum(len(it.draft_token_ids) + 1 for it in jobs)  # before cuts: an upper bound
        rows = torch.empty((total, self.words), dtype=torch.int32)  # [R, words]; rows past a cut are never read
        masks = StepMasks(rows)
        plain: list[tuple[llguidance.LLMatcher, int]] = []  # (matcher, its row)
        drafted: list[tuple[ScheduledSeq, llguidance.LLMatcher, int]] = []
        r = 0
        for item in jobs:
            masks.first_row[item.seq.seq_id] = r
            m = self._matchers[item.seq.seq_id]
            if item.draft_token_ids:
                drafted.append((item, m, r))
            else:
                plain.append((m, r))
            r += len(item.draft_token_ids) + 1
        mode = self.fill
        if drafted:
            self._walk_drafts(drafted, rows, mode)
        if len(plain) > 1 and mode is FillMode.OVERLAP:
            masks.pending = self._pending = self._background().submit(self._fill_rows, plain, rows, mode)
        elif plain:  # one row overlapped: the hand-off to the fill's thread (~20 us) costs about a mask
            self._fill_rows(plain, rows, mode)
        return masks

    def _fill_rows(self, pairs: list[tuple[llguidance.LLMatcher, int]], rows: torch.Tensor, mode: FillMode) -> None:
        """Each matcher's next mask into its row of ``rows``: one after another (SERIAL), or
        all at once on llguidance's native pool, which runs off the GIL."""
        nbytes = self.words * 4
        if mode is FillMode.SERIAL:
            for m, r in pairs:
                m.unsafe_compute_mask_ptr(rows[r].data_ptr(), nbytes)
        else:
            self._native().unsafe_compute_mask_ptr(pairs, rows.data_ptr(), nbytes, rows.shape[0])

    def _walk_drafts(self, walks: list[tuple[ScheduledSeq, llguidance.LLMatcher, int]], rows: torch.Tensor,
                     mode: FillMode) -> None:
        """Fill each drafted item's masks from its first row ``r`` on: row r + j is the state
        after drafts 1..j. Wave j fills row r + j of every item still walking at once, then
        checks draft j + 1 of each; the matchers are rolled back afterwards.

        The first draft the grammar refuses ends the draft. A deterministic draft (one-hot q)
        drops it: the verification would surely reject it and then draw from p, which is what
        the draw after the kept drafts does. A sampled draft (draft probs q) keeps it as its
        last: dropping it would change which runs reach the verification, and the token drawn
        where it is rejected must come from norm(max(p - q, 0)) for the output to stay exactly
        p-distributed; p is 0 on it, so it is always rejected, and its next row (a copy) is
        never read. A drafted EOS the grammar allows ends the draft too (nothing follows it).
        """
        live, j = walks, 0
        while live:
            self._fill_rows([(m, r + j) for _, m, r in live], rows, mode)
            going = []
            for item, m, r in live:
                drafts = item.draft_token_ids
                keep = j
                if j < len(drafts):
                    tok = int(drafts[j])
                    allowed = _allowed(rows, r + j, tok)
                    if allowed and tok not in self.eos_token_ids and m.consume_token(tok):
                        going.append((item, m, r))
                        continue
                    keep = j if not allowed and item.draft_probs is None else j + 1
                    if keep > j:
                        rows[r + j + 1] = rows[r + j]
                if j:
                    m.rollback(j)  # j drafts consumed
                _cut_drafts(item, keep)
            live, j = going, j + 1

    def _settle(self) -> None:
        """Wait for an overlapped fill still running (a step whose forward failed before its
        masks were applied): nothing may touch a matcher while it is being filled. Its error,
        if any, is the step's (``StepMasks.apply`` raised it, or the forward failed first), not
        the next call's."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            wait([pending])

    def _native(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=self.fill_threads)
        return self._executor

    def _background(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-mask-fill")
        return self._thread


def _cut_drafts(item: ScheduledSeq, keep: int) -> None:
    drafts = item.draft_token_ids
    if keep < len(drafts):
        item.draft_token_ids = drafts[:keep]
        item.draft_probs = item.draft_probs[:keep] if item.draft_probs is not None and keep else None
        if not keep:
            item.draft_bucket = None
