"""Streaming text out of token ids: incremental detokenization and stop-string matching.

Both classes are per-request and hold only that request's state. Neither imports torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"  # what decode() yields for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas at bounded cost per step.

    Decoding a token alone is wrong in general: one character can span several byte-level
    tokens (emoji, CJK), and some tokenizers render a token differently after another one.
    So each step decodes a short window and emits only what the newest tokens added::

        tokens:  ... | prefix (already emitted) | unread (new, or held back) |
                     ^prefix_offset             ^read_offset               ^end

        delta = decode(prefix + unread)[len(decode(prefix)):]

    The delta is held back while it ends in U+FFFD (a character still missing bytes). On
    emission the window slides: unread becomes the next prefix, so a step decodes only the
    tokens since the previous emission plus the ones emitted then, never the whole output.
    The window starts with the last few prompt tokens as context.

    Invariant: deltas from ``step`` followed by ``flush()`` concatenate to
    ``tokenizer.decode(output_ids, skip_special_tokens=...)`` for byte-level BPE tokenizers.
    """

    # Prompt tokens kept as left context for the first output tokens.
    CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-self.CONTEXT_TOKENS :]) if prompt_token_ids else []
        prefix_text = self._decode(context)
        if prefix_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character; the output's first bytes belong to it, and
            # decode(output_ids) shows them as U+FFFD. Without context we emit the same.
            context, prefix_text = [], ""
        self._window: list[int] = context  # tokens[prefix_offset:]
        self._read = len(context)  # read_offset - prefix_offset
        self._prefix_text: str | None = prefix_text  # decode(window[:read]); None = stale

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add this step's tokens; return the text they complete ("" when held back)."""
        self._window.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (the request has finished)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text):
            return ""  # e.g. a skipped special token
        if text.endswith(_REPLACEMENT) and not final:
            return ""  # wait for the rest of the character
        delta = text[len(self._prefix_text) :]
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = None
        return delta


class StopStringMatcher:
    """Finds stop strings in streamed text, holding back what might be the start of one.

    ``feed`` returns the text that is safe to show now. A tail that is a proper prefix of
    some stop string is held until the next delta decides it (or ``flush`` at the end).
    The stop reported is the one that *completes* first in the character stream (ties: the
    longest), so the result does not depend on how the text was split into deltas.
    Once a stop has been hit the matcher is finished: further feeds return ("", True).
    """

    def __init__(self, stops: tuple[str, ...], include_stop_str_in_output: bool) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = stops
        self._include = include_stop_str_in_output
        self._max_hold = max((len(s) for s in stops), default=1) - 1
        self._held = ""
        self.hit: str | None = None  # the stop string that ended the text

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit)."""
        if self.hit is not None:
            return "", True
        buf = self._held + delta
        # Earlier text held no complete stop, so any match ends inside the new delta; buf
        # is at most len(delta) + longest stop, so scanning all of it stays cheap.
        best: tuple[int, int, str] | None = None  # (end, start, stop): earliest end, longest
        for stop in self._stops:
            start = buf.find(stop)  # a stop's first occurrence is also its earliest end
            if start >= 0:
                cand = (start + len(stop), start, stop)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            end, start, stop = best
            self.hit, self._held = stop, ""
            return buf[: end if self._include else start], True
        hold = self._held_tail(buf)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Release the held tail (the request ended without a stop string)."""
        held, self._held = self._held, ""
        return "" if self.hit is not None else held

    def _held_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        for n in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self._stops):
                return n
        return 0
