"""SequenceText on a hand-built byte-level tokenizer: deltas, stop strings (held back, cut,
included), runs of several tokens, split characters and a resumed request's replay."""
from __future__ import annotations

import pytest

from engine.sequence_text import SequenceText


class ByteTokenizer:
    """Token id -> bytes; decoding an incomplete UTF-8 sequence yields U+FFFD, as byte-level BPE
    tokenizers do."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")

    def ids(self, *pieces: bytes) -> list[int]:
        return [self.pieces.index(p) for p in pieces]


SMILE = "😀".encode()
TOK = ByteTokenizer([b"<p>", b"Hello", b" wor", b"ld", b"!", b" ab", b"c", b"x", SMILE[:2], SMILE[2:]])
PROMPT = TOK.ids(b"<p>")


def feed(text: SequenceText, ids: list[int], final_at_end: bool = True) -> list[str]:
    """One token per step, the last one final; the deltas."""
    return [text.append([t], final=final_at_end and i == len(ids) - 1)[0] for i, t in enumerate(ids)]


def test_without_stops_deltas_are_the_text():
    text = SequenceText(TOK, PROMPT)
    deltas = feed(text, TOK.ids(b"Hello", b" wor", b"ld", b"!"))
    assert deltas == ["Hello", " wor", "ld", "!"]
    assert text.text == "Hello world!"


def test_a_stop_string_split_across_tokens_is_held_then_cut():
    text = SequenceText(TOK, PROMPT, stop=("world",))
    ids = TOK.ids(b"Hello", b" wor", b"ld", b"!")
    assert text.append(ids[:1], final=False) == ("Hello", None)
    assert text.append(ids[1:2], final=False) == (" ", None)  # "wor" may start the stop string
    assert text.append(ids[2:3], final=False) == ("", 1)  # completed by this token
    assert text.text == "Hello "


def test_include_stop_str_in_output():
    text = SequenceText(TOK, PROMPT, stop=("world",), include_stop_str_in_output=True)
    assert "".join(feed(text, TOK.ids(b"Hello", b" wor", b"ld"), final_at_end=False)) == "Hello world"
    assert text.text == "Hello world"


def test_a_stop_inside_a_run_keeps_the_tokens_up_to_it():
    """A verification emits several tokens at once: those after the stop are not read."""
    text = SequenceText(TOK, PROMPT, stop=("wor",))
    delta, kept = text.append(TOK.ids(b"Hello", b" wor", b"ld", b"!"), final=True)
    assert (delta, kept) == ("Hello ", 2)
    assert text.text == "Hello "


def test_a_stop_on_the_last_token_of_a_run():
    text = SequenceText(TOK, PROMPT, stop=("!",))
    assert text.append(TOK.ids(b"Hello", b"!"), final=False) == ("Hello", 2)


def test_the_end_releases_a_held_partial_stop_string():
    text = SequenceText(TOK, PROMPT, stop=(" abcd",))
    ids = TOK.ids(b"Hello", b" ab", b"c")
    assert feed(text, ids) == ["Hello", "", " abc"]
    assert text.text == "Hello abc"


def test_a_held_prefix_is_released_when_it_diverges():
    text = SequenceText(TOK, PROMPT, stop=(" abcd",))
    assert feed(text, TOK.ids(b" ab", b"x"), final_at_end=False) == ["", " abx"]


def test_a_split_character_waits_for_its_bytes():
    text = SequenceText(TOK, PROMPT)
    assert feed(text, TOK.ids(b"Hello", SMILE[:2], SMILE[2:])) == ["Hello", "", "😀"]


def test_the_end_flushes_half_a_character():
    text = SequenceText(TOK, PROMPT)
    assert feed(text, TOK.ids(b"Hello", SMILE[:2])) == ["Hello", "\ufffd"]


def test_after_a_stop_nothing_more_is_shown():
    text = SequenceText(TOK, PROMPT, stop=("ld",))
    assert feed(text, TOK.ids(b" wor", b"ld"), final_at_end=False) == [" wor", ""]
    assert text.append(TOK.ids(b"!"), final=True) == ("", 1)
    assert text.text == " wor"


@pytest.mark.parametrize("stop", [(), (" abcd",)])
def test_a_resumed_request_goes_on_where_the_client_stopped(stop):
    """The other node held back half a character (and the start of a possible stop string);
    this node's first delta starts with it, so the client's text is the uninterrupted one."""
    sent = TOK.ids(b"Hello", b" ab", SMILE[:2])
    rest = TOK.ids(SMILE[2:], b"!")
    whole = SequenceText(TOK, PROMPT, stop)
    deltas = feed(whole, sent + rest)
    resumed = SequenceText(TOK, PROMPT, stop, sent_token_ids=sent)
    assert feed(resumed, rest) == deltas[len(sent):]
    assert deltas[len(sent)] == (" ab😀" if stop else "😀")
    assert resumed.text == "".join(deltas[len(sent):])  # the replayed text was sent elsewhere
