"""A reasoning model's thinking apart from its answer (shared/reasoning.py): each parser's reading of whole
answers, and a stream's pieces (whole, a character at a time, in thirds) adding up to the same reasoning and
content, holding back only what could still be part of a tag."""

import pytest

from shared.reasoning import ReasoningSplitter, split_reasoning

TEXTS = [
    "<think>a</think>b",
    "  <think>\nhm</think>\n\nok",
    "plain",
    "<think>cut short",
    "<thi",
    "",
    "</think>x",
    "r</think>c",
    "<think></think>x",
    "<think>a</think>b</think>c",
    "<think><think>nested?</think>x",
    "<thinking>not the tag</thinking>",
    "< think>spaced</think>",
    "<think>ends on a partial </thi",
]
WANT = {  # text -> (qwen3, deepseek_r1)
    "<think>a</think>b": (("a", "b"), ("a", "b")),
    "plain": ((None, "plain"), ("plain", "")),
    "<think>cut short": (("cut short", ""), ("cut short", "")),
    "r</think>c": ((None, "r</think>c"), ("r", "c")),
    "<think></think>x": (("", "x"), ("", "x")),
    "<thinking>not the tag</thinking>": ((None, "<thinking>not the tag</thinking>"), ("<thinking>not the tag</thinking>", "")),
}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_whole_answers(parser: str) -> None:
    for text, (qwen3, r1) in WANT.items():
        assert split_reasoning(text, parser) == (qwen3 if parser == "qwen3" else r1), text  # type: ignore[arg-type]


def test_none_is_all_content() -> None:
    for text in TEXTS:
        assert split_reasoning(text, "none") == (None, text)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1", "none"])
def test_a_stream_adds_up_to_the_whole_answer(parser: str) -> None:
    for text in TEXTS:
        want_reasoning, want_content = split_reasoning(text, parser)  # type: ignore[arg-type]
        third = max(1, len(text) // 3)
        for pieces in ([text], list(text), [text[:third], text[third : 2 * third], text[2 * third :]]):
            splitter = ReasoningSplitter(parser)  # type: ignore[arg-type]
            parts = [splitter.feed(p) for p in pieces] + [splitter.finish()]
            assert "".join(r for r, _ in parts) == (want_reasoning or ""), (text, pieces)
            assert "".join(c for _, c in parts) == want_content, (text, pieces)


def test_only_a_possible_tag_is_held() -> None:
    splitter = ReasoningSplitter("qwen3")
    assert splitter.feed("<th") == ("", "")  # could be <think>
    assert splitter.feed("ink>I wonder") == ("I wonder", "")
    assert splitter.feed(" if</th") == (" if", "")  # `</th` could begin </think>
    assert splitter.feed("e answer") == ("</the answer", "")  # it did not
    assert splitter.feed("</think>42") == ("", "42")
    assert splitter.feed(" more") == ("", " more")
