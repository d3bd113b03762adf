"""vLLM's chat-template controls of a chat request (`/v1/jobs` with `messages`, `/v1/chat/completions`), checked
where the request is validated; the worker renders the messages with them (workers/worker/prompts.py).

- `add_generation_prompt` (default true): the prompt ends by opening the assistant's turn; false leaves it closed.
- `continue_final_message`: the last message, the assistant's, stays open and the answer goes on from its text
  (an answer's start given by the caller); it needs `add_generation_prompt: false`, as vLLM's.
- `chat_template_kwargs`: the template's own variables (Qwen3's `enable_thinking`, ...), never the names the
  template call or its context take for themselves.
"""

import json
from typing import Any

MAX_KWARGS = 32
MAX_KWARGS_CHARS = 8192  # the variables as JSON
# apply_chat_template's own arguments and the names its template context holds
RESERVED_NAMES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception", "strftime_now",
})  # fmt: skip


def checked_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """`chat_template_kwargs` as given, or ValueError naming what is wrong."""
    if value is None:
        return None
    for name in value:
        if not name.isidentifier():
            raise ValueError(f"`{name}` is not a template variable's name")
        if name in RESERVED_NAMES:
            raise ValueError(f"`{name}` is the template call's own name, not a variable a request may set")
    if len(json.dumps(value)) > MAX_KWARGS_CHARS:
        raise ValueError(f"at most {MAX_KWARGS_CHARS} characters of JSON")
    return value


def check_continuation(continue_final_message: bool, add_generation_prompt: bool, last_role: str | None) -> None:
    """ValueError where `continue_final_message` cannot hold."""
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise ValueError("needs add_generation_prompt: false (the answer goes on in the last message, not a new one)")
    if last_role is not None and last_role != "assistant":
        raise ValueError(f"needs the last message to be the assistant's, not the {last_role}'s")
