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
