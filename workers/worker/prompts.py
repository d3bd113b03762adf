"""A job's request -> what the engine takes: prompt (text, or token ids: given, or resuming), SamplingParams, and its
queue as the engine's priority number (lower = more urgent: interactive 0, default 1, batch 2)."""

from typing import Any

import jinja2

from shared.response_format import answer_grammar
from shared.schemas import JobRequest, Priority
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling_params import SamplingParams


def prompt_text(request: JobRequest, tokenizer: Any) -> str:
    """The prompt, or the messages rendered with the tokenizer's chat template and the request's controls
    (shared/chat_template.py); without a template, one line a message, `"{role}: {content}\n"`, then
    `"assistant:"` (a continued last message: its line left open, nothing after it). A template that refuses the
    messages (its raise_exception: roles out of order, ...) is the request's error, naming `messages`."""
    if request.prompt is not None:
        return request.prompt
    messages = [m.model_dump() for m in request.messages or []]
    if getattr(tokenizer, "chat_template", None):
        try:
            return str(tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, **(request.chat_template_kwargs or {}),
            ))  # fmt: skip
        except jinja2.TemplateError as exc:
            raise InvalidRequestError("messages", f"the model's chat template refused them: {exc}") from exc
    lines = [f"{m['role']}: {m['content']}\n" for m in messages]
    if request.continue_final_message:
        return "".join(lines)[:-1]
    return "".join(lines) + ("assistant:" if request.add_generation_prompt else "")


def engine_prompt(request: JobRequest, tokenizer: Any, resumed_token_ids: list[int]) -> str | list[int]:
    """Text for a first attempt; token ids (prompt + earlier output) for one that resumes a job, or whose prompt
    came as token ids."""
    if request.prompt_token_ids is not None:
        return [*request.prompt_token_ids, *resumed_token_ids]
    text = prompt_text(request, tokenizer)
    if not resumed_token_ids:
        return text
    return list(tokenizer.encode(text, add_special_tokens=False)) + resumed_token_ids  # as Engine._tokenize


def sampling_params(request: JobRequest, max_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for this request (the engine validates them in add_request)."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        stop=list(request.stop),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        stop_token_ids=list(request.stop_token_ids),
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        speculative=request.speculative_method,
        logprobs=request.logprobs,
        prompt_logprobs=request.prompt_logprobs,
        grammar=answer_grammar(request.response_format, request.structured_outputs),
        logit_bias=dict(request.logit_bias) if request.logit_bias else None,
        allowed_token_ids=list(request.allowed_token_ids) if request.allowed_token_ids else None,
        cache_salt=request.cache_salt,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
    )


_PRIORITIES = list(Priority)  # highest first


def engine_priority(priority: Priority) -> int:
    """The engine's priority number of a queue: its place in Priority's order, 0 = interactive."""
    return _PRIORITIES.index(priority)


def priority_of(engine_priority_value: int) -> Priority:
    """engine_priority's inverse (a value past the last queue counts as the last)."""
    return _PRIORITIES[min(engine_priority_value, len(_PRIORITIES) - 1)]
