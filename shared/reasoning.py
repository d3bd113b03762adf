"""Reasoning models' thinking, apart from their answer: OpenAI-compatible servers (vLLM, SGLang, DeepSeek's API)
return it as the chat message's `reasoning_content`, and a stream's `delta.reasoning_content`, so that clients
show or drop it and the answer is `content` alone. `settings.reasoning_parser` names the model's convention:

- `qwen3` (Qwen3, QwQ and most `<think>` models): the model opens its thinking itself. An answer that begins
  (after whitespace) with `<think>` thinks until `</think>`, or to its end when it was cut; any other answer is
  content alone.
- `deepseek_r1` (DeepSeek-R1 and its distillations): the chat template opens the thinking, so the answer starts
  inside it (a leading `<think>` the model writes anyway is dropped) and thinks until `</think>`, or to its end.
- `none` (the default): no reasoning, the text is content.

`ReasoningSplitter` reads a text in pieces (a stream's token events) and says, piece by piece, what is
reasoning and what is content, holding back only what could still be part of a tag; the whole answer is read
by the same machine in one piece (`split_reasoning`), so a stream's deltas add up to the answer without stream.
"""

from typing import Literal

ReasoningParser = Literal["none", "qwen3", "deepseek_r1"]
START, END = "<think>", "</think>"


class ReasoningSplitter:
    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        # opening: deciding whether (and where) the thinking starts; thinking: until END; answering: content
        self.state = "answering" if parser == "none" else "opening"
        self.held = ""  # text not given out yet: a possible START (opening) or a possible END's beginning (thinking)
        self.has_thought = False  # the answer has a thinking part (an empty one too: `<think></think>`)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of this piece that can be given out now."""
        self.held += text
        if self.state == "opening":
            rest = self.held.lstrip()
            if len(rest) < len(START) and START.startswith(rest):
                return "", ""  # still could be `<think>`
            if rest.startswith(START):
                self._think(rest[len(START):])
            elif self.parser == "deepseek_r1":  # the template opened it: the answer starts thinking
                self._think(self.held)
            else:
                self.state = "answering"
        if self.state == "thinking":
            before, found, after = self.held.partition(END)
            if found:
                self.state, self.held = "answering", ""
                return before, after
            keep = _possible_end_start(self.held)  # the tail that could begin END waits for the next piece
            reasoning, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
            return reasoning, ""
        content, self.held = self.held, ""
        return "", content

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) of what is still held once the text ended."""
        if self.state == "opening" and self.parser == "deepseek_r1":
            self._think(self.held)
        held, self.held = self.held, ""
        return (held, "") if self.state == "thinking" else ("", held)

    def _think(self, text: str) -> None:
        self.state, self.held, self.has_thought = "thinking", text, True


def _possible_end_start(text: str) -> int:
    """The length of text's longest suffix that is a proper prefix of END."""
    for size in range(min(len(END) - 1, len(text)), 0, -1):
        if END.startswith(text[-size:]):
            return size
    return 0


def split_reasoning(text: str, parser: ReasoningParser) -> tuple[str | None, str]:
    """(reasoning, or None when the answer has no thinking part; content) of a whole answer."""
    splitter = ReasoningSplitter(parser)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return (reasoning + more_reasoning if splitter.has_thought else None), content + more_content
