"""Incremental detokenization on the tiny byte-level BPE tokenizer: UTF-8 across pieces, stop strings."""

from pathlib import Path

import pytest
import transformers

from workers.engine.detokenizer import Detokenizer, make_decode_fn


@pytest.fixture(scope="module")
def tokenizer(tiny_models: dict[str, Path]) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(str(tiny_models["llama"]))


def stream(tokenizer, text: str, stop: list[str]) -> tuple[list[str], bool, Detokenizer]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = Detokenizer(make_decode_fn(tokenizer), tokenizer.encode("x = ", add_special_tokens=False), stop)
    chunks, stopped = [], False
    for token in ids:
        stopped = detok.push(token)
        chunks.append(detok.take_new_text(stopped))
        if stopped:
            break
    if not stopped:
        chunks.append(detok.take_new_text(True))
    return chunks, stopped, detok


def test_multibyte_characters_are_never_split(tokenizer) -> None:
    text = "naïve café — 日本語 🚀 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # the rare characters really are split into byte pieces
    chunks, stopped, _ = stream(tokenizer, text, [])
    assert not stopped
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


def test_stop_string_spanning_tokens_cuts_text_and_never_leaks(tokenizer) -> None:
    text = "def f(x):\n    return x + 1\n\ndef g(y):\n    return y"
    chunks, stopped, detok = stream(tokenizer, text, ["\n\ndef"])
    assert stopped
    assert "".join(chunks) == "def f(x):\n    return x + 1"
    assert detok.text == "def f(x):\n    return x + 1"


def test_text_that_may_begin_a_stop_string_is_held_back(tokenizer) -> None:
    detok = Detokenizer(make_decode_fn(tokenizer), [], ["STOP!"])
    emitted = ""
    for token in tokenizer.encode("abc STO", add_special_tokens=False):
        detok.push(token)
        emitted += detok.take_new_text(False)
    assert emitted == "abc "  # "STO" could still become "STOP!"
    assert detok.take_new_text(True) == "STO"  # finishing for another reason releases it


def test_earliest_of_several_stop_strings_wins(tokenizer) -> None:
    chunks, stopped, _ = stream(tokenizer, "alpha beta gamma delta", ["delta", "beta"])
    assert stopped and "".join(chunks) == "alpha "


PIECES = {1: "abcd", 2: "q", 3: "a", 4: "b", 5: "hello ", 6: "wor", 7: "ld", 8: ". ", 9: "more"}


def pieces_decode(ids) -> str:
    """A tokenizer whose tokens are whole strings (PIECES): what a stop string meets, not how bytes join."""
    return "".join(PIECES[i] for i in ids)


def test_the_stop_string_that_completes_first_stops_whatever_the_tokens() -> None:
    """One token completing two stop strings: the one that a character-by-character stream would have met first
    ("bc"), as where "abc" and "d" were two tokens; the output ends before it, or with it when asked."""
    for include, want in ((False, "a"), (True, "abc")):
        detok = Detokenizer(pieces_decode, [], ["abcd", "bc"], include_stop=include)
        assert detok.push(1) and detok.take_new_text(True) == want


def test_include_stop_keeps_the_stop_string_and_holds_nothing_back() -> None:
    """vLLM's include_stop_str_in_output: text that may begin a stop string goes out at once (the output would
    hold it either way), and the output ends with the stop string."""
    held, kept = (Detokenizer(pieces_decode, [], ["world."], include_stop=flag) for flag in (False, True))
    for detok in (held, kept):
        assert not detok.push(5) and not detok.push(6)
    assert held.take_new_text(False) == "hello " and kept.take_new_text(False) == "hello wor"
    assert not kept.push(7) and kept.take_new_text(False) == "ld"
    assert kept.push(8) and kept.take_new_text(True) == "." and kept.text == "hello world."


def test_a_stop_string_in_unchecked_text_stops_nothing_later() -> None:
    """min_tokens pushes its tokens unchecked: a short stop string ("a") that ended there is not found by the
    next checked push, whose window reaches back for the longer one ("xab")."""
    detok = Detokenizer(pieces_decode, [], ["a", "xab"])
    assert not detok.push(2, check_stop=False) and not detok.push(3, check_stop=False)
    assert not detok.push(4) and detok.take_new_text(True) == "qab"
    assert detok.push(3) is True  # a checked "a" stops
