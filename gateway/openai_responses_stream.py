"""A response on a stream: OpenAI's Responses events, from the chat deltas of its answer (gateway/openai_stream_chat.py
ChoiceText: the thinking apart, the content as text or function calls), so the items a stream opens are the ones the
stored response has (shared/openai_response_object.py: same ids, same texts).

    response.created, response.in_progress
    per item: response.output_item.added, then
        reasoning:      response.reasoning_text.delta ... response.reasoning_text.done
        message:        response.content_part.added, response.output_text.delta ... response.output_text.done,
                        response.content_part.done
        function_call:  response.function_call_arguments.delta ... response.function_call_arguments.done
      response.output_item.done (the item as the stored response has it)
    response.completed | response.incomplete | response.failed (the whole response)

Each event is `event: <type>` + `data: <json>` with a `sequence_number` counted from 0. A job's events are kept, so
the same job gives the same events again: a stream resumed `starting_after` N is the events after the N-th.
"""

import json
from typing import Any

from shared import openai_compat as oa
from shared import openai_response_object as ro


class ResponseEvents:
    def __init__(self, job_id: str, starting_after: int = -1) -> None:
        self.job_id = job_id
        self.starting_after = starting_after  # a resumed stream: the events up to this sequence_number are b""
        self.num_sent = 0  # the next event's sequence_number
        self.num_items = 0  # output items opened so far (the next one's output_index)
        self.open: dict[str, Any] | None = None  # the item being streamed (its `output_item.added` went out)
        self.open_kind = ""  # reasoning | message | function_call
        self.open_text = ""  # its text (or arguments) so far
        self.has_answer = False  # a message or a call was opened

    def frame(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.num_sent, **data}
        self.num_sent += 1
        if payload["sequence_number"] <= self.starting_after:
            return b""
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()

    def opening(self, response: ro.Response) -> list[bytes]:
        body = response.model_dump(mode="json")
        return [self.frame("response.created", response=body), self.frame("response.in_progress", response=body)]

    def on_delta(self, delta: oa.ChatDelta, logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        """The events of one delta; `logprobs` (include `message.output_text.logprobs`) ride its text."""
        frames: list[bytes] = []
        if delta.reasoning_content:
            frames += self._text("reasoning", ro.reasoning_id(self.job_id), delta.reasoning_content)
        if delta.content or logprobs:
            frames += self._text("message", ro.message_id(self.job_id), delta.content or "", logprobs)
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call's first piece: a new item
                frames += self._close()
                item = {"type": "function_call", "id": ro.function_call_item_id(self.job_id, call.index),
                        "call_id": call.id, "name": call.function.name, "arguments": "", "status": "in_progress"}  # fmt: skip
                frames += self._open("function_call", item)
            if call.function.arguments:
                self.open_text += call.function.arguments
                frames.append(self.frame("response.function_call_arguments.delta", item_id=self._item_id(),
                                         output_index=self.num_items - 1, delta=call.function.arguments))  # fmt: skip
        return frames

    def closing(self, response: ro.Response) -> list[bytes]:
        """The last events: the open item closed (an answer with no text still has its empty message), then the
        response as it ended (`response.completed`, `.incomplete` or `.failed`)."""
        frames = self._close(response)
        if response.status in ("completed", "incomplete") and not self.has_answer:
            frames += self._text("message", ro.message_id(self.job_id), "")
            frames += self._close(response)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(response.status, "response.failed")
        return frames + [self.frame(kind, response=response.model_dump(mode="json"))]

    # -- items ------------------------------------------------------------------------------------------------
    def _item_id(self) -> str:
        assert self.open is not None
        return str(self.open["id"])

    def _open(self, kind: str, item: dict[str, Any]) -> list[bytes]:
        self.open, self.open_kind, self.open_text = item, kind, ""
        self.has_answer = self.has_answer or kind != "reasoning"
        frames = [self.frame("response.output_item.added", output_index=self.num_items, item=item)]
        self.num_items += 1
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            frames.append(self.frame("response.content_part.added", item_id=item["id"], output_index=self.num_items - 1,
                                     content_index=0, part=part))  # fmt: skip
        return frames

    def _text(self, kind: str, item_id: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        frames: list[bytes] = []
        if self.open is None or self.open_kind != kind:
            frames += self._close()
            content: dict[str, Any] = {"content": []} if kind == "message" else {"summary": [], "content": []}
            item = {"type": kind, "id": item_id, "status": "in_progress", **content}
            if kind == "message":
                item["role"] = "assistant"
            frames += self._open(kind, item)
        self.open_text += text
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": logprobs or []} if kind == "message" else {}
        if text or logprobs:
            frames.append(self.frame(event, item_id=item_id, output_index=self.num_items - 1, content_index=0,
                                     delta=text, **extra))  # fmt: skip
        return frames

    def _close(self, response: ro.Response | None = None) -> list[bytes]:
        """The open item's last events; its final form is the response's item of the same id when the response is
        known (the end), else what was streamed, completed."""
        if self.open is None:
            return []
        item_id, index, text = self._item_id(), self.num_items - 1, self.open_text
        final = next((i.model_dump(mode="json") for i in (response.output if response else []) if i.id == item_id), None)
        frames: list[bytes] = []
        if self.open_kind == "message":
            part = final["content"][0] if final else {"type": "output_text", "text": text, "annotations": []}
            frames.append(self.frame("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                                     text=part["text"], logprobs=part.get("logprobs") or []))  # fmt: skip
            frames.append(self.frame("response.content_part.done", item_id=item_id, output_index=index,
                                     content_index=0, part=part))  # fmt: skip
            final = final or {**self.open, "status": "completed", "content": [part]}
        elif self.open_kind == "reasoning":
            frames.append(self.frame("response.reasoning_text.done", item_id=item_id, output_index=index,
                                     content_index=0, text=text))  # fmt: skip
            final = final or {**self.open, "status": "completed", "content": [{"type": "reasoning_text", "text": text}]}
        else:
            arguments = final["arguments"] if final else text
            frames.append(self.frame("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                     arguments=arguments))  # fmt: skip
            final = final or {**self.open, "status": "completed", "arguments": arguments}
        frames.append(self.frame("response.output_item.done", output_index=index, item=final))
        self.open = None
        return frames
