"""One sample's streamed text: token ids in, text deltas out, stop strings applied.

Plain data, no torch: the pieces are ``tokens.detokenizer``'s, put together the one way the
engine uses them::

    token id -> IncrementalDetokenizer -> StopStringMatcher -> delta (safe to show now)
                holds back part of a      holds back what may be
                character                 the start of a stop string

At the sample's last token both hold-backs are released (``final``), except that text after a
stop string is never shown. The engine only has to act on a hit: finish the sequence and drop
the tokens after the one that completed the stop string.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokens.detokenizer import IncrementalDetokenizer, StopStringMatcher


class SequenceText:
    """The text of one sample so far, with its detokenizer and stop-string state."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        sent_token_ids: Sequence[int] = (),
    ) -> None:
        """``sent_token_ids``: output tokens another node already streamed (a resumed request).
        They are replayed one by one as that node did, so what it held back (part of a
        character, the start of a stop string) is held here too, and the text goes on exactly
        where the client's stopped; their text is not part of ``text``."""
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = StopStringMatcher(tuple(stop), include_stop_str_in_output) if stop else None
        self.text = ""  # every delta returned so far
        for token in sent_token_ids:
            sent = self._detok.step([token])
            if self._stops is not None:
                self._stops.feed(sent)

    def append(self, token_ids: Sequence[int], final: bool) -> tuple[str, int | None]:
        """Add a step's new tokens (several after a verification); ``final``: the sample ends
        with the last of them.

        -> (text delta, kept): ``kept`` is None unless a stop string ended the text, then the
        number of ``token_ids`` up to and including the one that completed it; the tokens
        after it are not read (they were never output).
        """
        delta = ""
        for i, token in enumerate(token_ids):
            last = final and i == len(token_ids) - 1
            part = self._detok.step([token])
            if last:  # text held back for a split character is final now
                part += self._detok.flush()
            hit = False
            if self._stops is not None:
                part, hit = self._stops.feed(part)
                if last and not hit:
                    part += self._stops.flush()  # a held-back partial stop string was just text
            delta += part
            if hit:
                self.text += delta
                return delta, i + 1
        self.text += delta
        return delta, None
