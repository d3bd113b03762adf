"""Incremental detokenization with stop strings.

Text is released only once it is final: never half a UTF-8 character (a byte-level BPE token can end
inside one; its decode then ends in U+FFFD and we wait for the next token), and never a tail that could
still turn out to be the start of a stop string. A stop string may span any number of tokens; the text
is cut where it begins (where it ends with vLLM's `include_stop_str_in_output`: then nothing need be held back)
and nothing after it is emitted. Each push looks for the stop strings that end in its own text, so the first one
to complete is the one that stops. A token pushed with `check_stop` off (vLLM's `min_tokens`:
the output is still too short to stop) adds its text without a search, so a stop string that ends in that text
never stops the output; one that ends in a later token's text does.
"""

from collections.abc import Callable, Sequence

PROMPT_CONTEXT_TOKENS = 6  # prompt tokens kept as decoding context (sentencepiece-style leading spaces)
REPLACEMENT_CHAR = "\ufffd"


def make_decode_fn(tokenizer, skip_special_tokens: bool = True) -> Callable[[Sequence[int]], str]:
    """The fastest faithful decode the tokenizer offers (the Rust backend when there is one); special tokens
    (EOS, chat markers) leave no text unless `skip_special_tokens` is False (vLLM's request parameter)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)  # fmt: skip


class Detokenizer:
    def __init__(
        self, decode: Callable[[Sequence[int]], str], prompt_ids: Sequence[int], stop: Sequence[str],
        include_stop: bool = False,
    ) -> None:
        self.decode = decode
        self.ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])  # context + output tokens
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decode to text already counted
        self.read_offset = len(self.ids)
        self.text = ""  # the output text so far (complete characters only, cut at a stop string)
        self.num_emitted_chars = 0
        self.stop = tuple(stop)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.include_stop = include_stop  # the output ends with the stop string it met

    def push(self, token_id: int, check_stop: bool = True) -> bool:
        """Add one output token; True when a stop string ending in its text has just been completed (the text is
        cut where it begins). check_stop False: only add its text."""
        self.ids.append(token_id)
        prefix_text = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return False  # an incomplete character: wait for more bytes
        new_text = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        old_len = len(self.text)
        self.text += new_text
        return check_stop and self._cut_at_stop(old_len)

    def _cut_at_stop(self, old_len: int) -> bool:
        """Cut at the first stop string that ends past old_len (in the text just added)."""
        hits = [(i + len(s), i) for s in self.stop if (i := self.text.find(s, max(0, old_len - len(s) + 1))) >= 0]
        if not hits:
            return False
        end, start = min(hits)  # the first to complete; of those ending together, the longest
        self.text = self.text[: end if self.include_stop else start]
        return True

    def take_new_text(self, is_final: bool) -> str:
        """Text that became final since the last call; on the final call, everything left."""
        end = len(self.text) if is_final else len(self.text) - self._held_back_chars()
        end = max(end, self.num_emitted_chars)
        new = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return new

    def _held_back_chars(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        if self.include_stop:
            return 0  # were it to become one, the output would hold it all the same
        for size in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-size:]
            if any(s.startswith(tail) for s in self.stop):
                return size
        return 0
