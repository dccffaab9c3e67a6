"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the text's tail.

Input-grounded generation (summarise, extract, edit a given text or code) copies spans of the
prompt, so the tail of the output often occurred before and the tokens after that occurrence
are a good guess. No weights, no KV: drafting costs a scan of the token list.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.config import SpeculativeConfig
from engine.speculative.proposer import DraftRequest, Proposal


def ngram_propose(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    of ``tokens`` with n_max >= n >= n_min tokens; [] when no such suffix occurred before::

        tokens   a b c d x b c d
        n = 3    suffix "b c d" also at 1..3  -> propose tokens from 4: "x b c" (k = 3)
    """
    return ngram_match(tokens, k, n_min, n_max)[1]


def ngram_match(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> tuple[int, list[int]]:
    """(n, draft): ``ngram_propose``'s draft and the length n of the suffix it matched (0: none).

    n is what the draft's acceptance depends on most: a 1-token match is a weak guess, a long
    one is usually right (docs/benchmarks.md, "Figures behind constants"); the controller keeps
    acceptance per n and trims each draft accordingly.
    """
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = list(tokens[size - n:])
        last = suffix[-1]
        # Candidate starts i with tokens[i : i + n] == suffix, latest first; i + n <= size - 1
        # so at least one token follows the occurrence.
        for end in range(size - 2, n - 2, -1):  # end = i + n - 1, the occurrence's last token
            if tokens[end] != last:
                continue
            i = end - n + 1
            if list(tokens[i:end + 1]) == suffix:
                return n, list(tokens[end + 1 : end + 1 + k])
    return 0, []


class NgramProposer:
    draft_cost = 0.0
    batched = True
    target_states = None

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            n, draft = ngram_match(r.seq.token_ids, r.k, self.n_min, self.n_max)
            out.append(Proposal(draft, bucket=n if draft else None))
        return out

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pass  # no KV

    def forget(self, seq_id: str) -> None:
        pass


def from_engine(engine) -> NgramProposer:
    cfg: SpeculativeConfig = engine.config.speculative
    return NgramProposer(cfg.ngram_min, cfg.ngram_max)
