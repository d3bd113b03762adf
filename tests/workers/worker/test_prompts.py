"""A job's request -> the engine's prompt: text, or token ids (given, or a resumed job's prompt + output); chat
messages rendered with the tokenizer's chat template and vLLM's controls (add_generation_prompt,
continue_final_message, chat_template_kwargs), or plainly where the tokenizer has none."""

from pathlib import Path

import pytest
import transformers
from pydantic import ValidationError

from shared.schemas import JobRequest
from workers.engine.errors import InvalidRequestError
from workers.worker.prompts import engine_prompt, prompt_text

# a ChatML-like template with a variable of its own, as Qwen3's `enable_thinking`, and a refusal of its own
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'system' and not loop.first %}{{ raise_exception('a system message comes first') }}{% endif %}"
    "<|{{ m.role }}|>{{ m.content }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f(x):"}]


@pytest.fixture(scope="module")
def templated(tiny_target: Path) -> transformers.PreTrainedTokenizerBase:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_target))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def plain(tiny_target: Path) -> transformers.PreTrainedTokenizerBase:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_target))
    assert not tokenizer.chat_template
    return tokenizer


def test_token_ids_go_as_they_are_and_a_resumed_job_appends_its_output() -> None:
    request = JobRequest(prompt_token_ids=[5, 6, 7], max_tokens=4)
    assert engine_prompt(request, None, []) == [5, 6, 7]  # no tokenizer: token ids need none
    assert engine_prompt(request, None, [9, 10]) == [5, 6, 7, 9, 10]


def test_the_chat_template_renders_the_messages_with_the_request_s_controls(templated) -> None:
    user = CHAT[:1]
    assert prompt_text(JobRequest(messages=user), templated) == "<|user|>hi<|end|><|assistant|>"
    closed = JobRequest(messages=user, add_generation_prompt=False)
    assert prompt_text(closed, templated) == "<|user|>hi<|end|>"
    continued = JobRequest(messages=CHAT, add_generation_prompt=False, continue_final_message=True)
    assert prompt_text(continued, templated) == "<|user|>hi<|end|><|assistant|>def f(x):"  # left open
    no_thinking = JobRequest(messages=user, chat_template_kwargs={"enable_thinking": False})
    assert prompt_text(no_thinking, templated) == "<|user|>hi<|end|><|assistant|><think></think>"


def test_a_template_s_refusal_is_the_request_s_error_naming_messages(templated) -> None:
    request = JobRequest(messages=[*CHAT[:1], {"role": "system", "content": "late"}])
    with pytest.raises(InvalidRequestError) as refused:
        prompt_text(request, templated)
    assert refused.value.field == "messages" and "a system message comes first" in refused.value.message


def test_without_a_template_one_line_a_message(plain) -> None:
    assert prompt_text(JobRequest(messages=CHAT[:1]), plain) == "user: hi\nassistant:"
    assert prompt_text(JobRequest(messages=CHAT[:1], add_generation_prompt=False), plain) == "user: hi\n"
    continued = JobRequest(messages=CHAT, add_generation_prompt=False, continue_final_message=True)
    assert prompt_text(continued, plain) == "user: hi\nassistant: def f(x):"


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        ({"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt", "messages` only"),
        ({"prompt": "x", "chat_template_kwargs": {"a": 1}}, "chat_template_kwargs", "messages` only"),
        ({"messages": CHAT, "continue_final_message": True}, "continue_final_message", "add_generation_prompt: false"),
        ({"messages": CHAT[:1], "continue_final_message": True, "add_generation_prompt": False},
         "continue_final_message", "the assistant's, not the user's"),
        ({"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "own name"),
        ({"messages": CHAT, "chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs", "variable's name"),
        ({"messages": CHAT, "chat_template_kwargs": {"x": "y" * 9000}}, "chat_template_kwargs", "8192 characters"),
    ],
)  # fmt: skip
def test_controls_that_cannot_hold_are_refused_naming_the_field(body, field, reason) -> None:
    with pytest.raises(ValidationError) as refused:
        JobRequest.model_validate(body)
    (error,) = refused.value.errors()
    assert error["loc"] == (field,) and reason in error["msg"], error
