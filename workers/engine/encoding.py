"""A prompt's token ids, as `tokenizer.encode(text, add_special_tokens=False)` gives them, at less cost.

transformers' `encode` on a fast tokenizer wraps one call of the Rust backend in Python of its own (keyword
handling, the truncation and padding set-up, a BatchEncoding built and unpacked): 19.6 µs for a short prompt
against the backend's 7.3 back to back, and, on a worker whose caches went cold while it waited for the job,
255 against 165 µs for the whole of `Engine.add_request` (the demo tokenizer, transformers 5.25, one core,
requests 30 ms apart, 2026-12-07): a job's first token waits for its admission. So the engine encodes through
the backend directly, where that is the same function: the tokenizer has a backend, and on PROBE_TEXTS (and the
tokenizer's own special tokens, which the backend matches whole) both give the same ids. A tokenizer whose
class adds Python of its own around the backend fails that check and keeps transformers' path (logged). Each
call also falls back while the backend holds a truncation or padding setting, or splits special tokens: what a
transformers call with those options leaves behind it, which transformers' next plain call would reset.
"""

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

PROBE_TEXTS = (
    "def parse(argv):\n    return argv[1:]\n",
    "  leading spaces, trailing space ",
    "The quick brown fox jumps over the lazy dog.",
    "unicode: héllo wörld, 日本語のテキスト, emoji 🙂👍🏽",
    "tabs\tand\r\nwindows line ends\n\n\nblank lines",
    "x",
    "",
)


def make_encode_fn(tokenizer: Any) -> Callable[[str], list[int]]:
    """text -> its token ids without special tokens added (BOS/EOS), as `tokenizer.encode` gives them."""

    def through_transformers(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return through_transformers

    def through_backend(text: str) -> list[int]:
        splits_specials = getattr(backend, "encode_special_tokens", False)  # tokenizers >= 0.15 has it
        if backend.truncation is not None or backend.padding is not None or splits_specials:
            return through_transformers(text)  # transformers resets those settings first
        return list(backend.encode(text, add_special_tokens=False).ids)

    specials = " ".join(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    probes = (*PROBE_TEXTS, specials, f"text{specials}text")
    try:
        mismatch = next((text for text in probes if through_backend(text) != through_transformers(text)), None)
    except Exception:  # noqa: BLE001 - a backend that cannot encode a probe is not used
        log.warning("tokenizer %s: its backend failed a probe; prompts are encoded through transformers",
                    type(tokenizer).__name__, exc_info=True)
        return through_transformers
    if mismatch is not None:
        log.info("tokenizer %s: its backend's ids differ from transformers' on %r; prompts are encoded through "
                 "transformers", type(tokenizer).__name__, mismatch)
        return through_transformers
    return through_backend
