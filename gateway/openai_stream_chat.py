"""A chat choice's text on a stream, when it is more than text: a reasoning model's thinking apart
(`delta.reasoning_content`, shared/reasoning.py), then its content as text or as function calls
(gateway/openai_stream_tools.py). The deltas add up to the message the call answers without `stream`
(shared/openai_compat.py `chat_answer`: the same splitter and the same reading of the content)."""

from gateway.openai_stream_tools import ToolCallStream
from shared import openai_compat as oa
from shared.reasoning import ReasoningParser, ReasoningSplitter
from shared.response_format import CallReading


class ChoiceText:
    def __init__(self, reasoning_parser: ReasoningParser, calls: CallReading | None, job_id: str) -> None:
        self.splitter = ReasoningSplitter(reasoning_parser)
        self.calls = ToolCallStream(calls, job_id) if calls is not None else None

    def on_text(self, text: str) -> list[oa.ChatDelta]:
        """The deltas of one token event's text (none while a piece is held)."""
        return self._deltas(*self.splitter.feed(text))

    def on_done(self, reason: oa.FinishReason | None) -> tuple[list[oa.ChatDelta], oa.FinishReason | None]:
        """The last deltas (what was held) and the answer's finish reason."""
        deltas = self._deltas(*self.splitter.finish())
        if self.calls is not None:
            last, reason = self.calls.on_done(reason)
            deltas += [last] if last is not None else []
        return deltas, reason

    def _deltas(self, reasoning: str, content: str) -> list[oa.ChatDelta]:
        deltas = [oa.ChatDelta(reasoning_content=reasoning)] if reasoning else []
        if content and self.calls is not None:
            piece = self.calls.on_text(content)
            deltas += [piece] if piece is not None else []
        elif content:
            deltas.append(oa.ChatDelta(content=content))
        return deltas
