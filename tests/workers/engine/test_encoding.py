"""A prompt's token ids through the tokenizer's Rust backend (workers/engine/encoding.py): the same ids as
`tokenizer.encode(text, add_special_tokens=False)`, on the tiny byte-level BPE tokenizer and its layouts; and
transformers' path wherever the backend would not give them."""

from pathlib import Path
from typing import Any

import pytest
import transformers

from workers.engine.encoding import make_encode_fn

TEXTS = [
    "def parse(argv):\n    return argv[1:]\n",
    "Ünïcödé and 中文 and 🙂 in one prompt",
    "  two spaces first, and a trailing one ",
    "<|endoftext|> a special token in the text<|endoftext|>",
    "\t\n\r\n",
    "a" * 3000,
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tokenizer(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(str(tiny_models[request.param]))


def transformers_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_the_backend_gives_transformers_ids(tokenizer: Any) -> None:
    encode = make_encode_fn(tokenizer)
    assert encode.__name__ == "through_backend"  # the tiny tokenizers pass the probes
    for text in TEXTS:
        assert encode(text) == transformers_ids(tokenizer, text), text


def test_a_truncating_call_before_does_not_truncate_a_prompt(tokenizer: Any) -> None:
    encode = make_encode_fn(tokenizer)
    text = TEXTS[0]
    full = transformers_ids(tokenizer, text)
    tokenizer(text, truncation=True, max_length=2, add_special_tokens=False)  # leaves truncation on the backend
    assert tokenizer.backend_tokenizer.truncation is not None
    assert encode(text) == full  # through transformers, which resets it
    assert encode(text) == full and tokenizer.backend_tokenizer.truncation is None  # and the backend again


class _Shifted:
    """A tokenizer whose class adds Python of its own around its backend: its ids are not the backend's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.backend_tokenizer = inner.backend_tokenizer
        self.all_special_tokens = inner.all_special_tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [i + 1 for i in self.inner.encode(text, add_special_tokens=add_special_tokens)]


def test_a_tokenizer_whose_ids_are_not_the_backend_s_keeps_its_own_encode(tokenizer: Any) -> None:
    shifted = _Shifted(tokenizer)
    encode = make_encode_fn(shifted)
    assert encode.__name__ == "through_transformers"
    assert encode(TEXTS[0]) == [i + 1 for i in transformers_ids(tokenizer, TEXTS[0])]


def test_a_tokenizer_without_a_backend_keeps_its_own_encode(tokenizer: Any) -> None:
    class Slow:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return transformers_ids(tokenizer, text)

    encode = make_encode_fn(Slow())
    assert encode.__name__ == "through_transformers" and encode(TEXTS[1]) == transformers_ids(tokenizer, TEXTS[1])
