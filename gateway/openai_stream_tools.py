"""Function calls on chat streams: a choice's chunks under active `tools`, written so that they add up to the
message the same call answers without `stream` (shared/openai_compat.py `answer_of`; the text it reads is the
answer's content, its thinking already apart: shared/reasoning.py).

- a named function (`tool_choice: {"type": "function", ...}`): the answer is the call's arguments, so they stream
  as they come: the first chunk opens the call (its id, type and name), each later one extends its arguments;
- `required` and `auto`: the answer is a call only if the whole text reads as one, so the text is held while it
  still could (`could_be_call`: only whitespace yet, or an object begun) and goes out as content once it cannot;
  at the end a held text is read as the answer without stream reads it: its calls in one chunk, or its text.
"""

from shared import openai_compat as oa
from shared.response_format import CallReading, ToolCallDelta, could_be_call, tool_call_id


class ToolCallStream:
    def __init__(self, calls: CallReading, job_id: str) -> None:
        self.calls = calls  # how the answer reads as calls (ToolSet.reading)
        self.job_id = job_id  # the choice's job: its calls' ids
        self.held = ""  # required/auto: the text so far, while it could still be a call
        self.is_text = False  # required/auto: the answer is text, streamed as content from here on
        self.is_open = False  # named: the call's first chunk went out

    def on_text(self, text: str) -> oa.ChatDelta | None:
        """The delta of one token event's text; None while it is held."""
        named = self.calls.named
        if named is not None:
            if self.is_open:
                return oa.ChatDelta(tool_calls=[ToolCallDelta.more_arguments(0, text)])
            self.is_open = True
            return oa.ChatDelta(tool_calls=[ToolCallDelta.opening(0, tool_call_id(self.job_id, 0), named, text)])
        if self.is_text:
            return oa.ChatDelta(content=text)
        self.held += text
        if could_be_call(self.held):
            return None
        self.is_text, text, self.held = True, self.held, ""
        return oa.ChatDelta(content=text)

    def on_done(self, reason: oa.FinishReason | None) -> tuple[oa.ChatDelta | None, oa.FinishReason | None]:
        """The last delta (what was held, or a named call that got no text) and the answer's finish reason."""
        if self.is_text or self.is_open:
            return None, reason
        message, reason = oa.answer_of(self.job_id, self.held, reason, self.calls)
        if message.tool_calls is None:
            return (oa.ChatDelta(content=self.held) if self.held else None), reason
        calls = [ToolCallDelta.opening(i, c.id, c.function.name, c.function.arguments)
                 for i, c in enumerate(message.tool_calls)]  # fmt: skip
        return oa.ChatDelta(tool_calls=calls), reason
