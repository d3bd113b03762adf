"""OpenAI `/v1/completions` and `/v1/chat/completions` <-> our jobs, in one place.

Batch lines use it now; the HTTP endpoints (a later issue) reuse it unchanged.

Request: `prompt` (a string, or a list holding one string) or `messages` (role + string content), with
`max_tokens`, `temperature`, `top_p`, `stop` (string or list), `seed`; `model`, `user`, `n` (1 only) and
`stream` (false only) are accepted. Chat messages go to the job as `messages`: the worker renders them with
the tokenizer's chat template, or without one as `"{role}: {content}\\n"` per message, then `"assistant:"`
(workers/worker/prompts.py). Defaults follow OpenAI: `max_tokens` 16 for completions, 256 (ours) for chat;
temperature 1, top_p 1. Unknown fields are refused (they would silently change nothing).

Response: the OpenAI `text_completion` / `chat.completion` object built from a finished job.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shared.schemas import Job, JobRequest, Message, Priority

COMPLETIONS_URL = "/v1/completions"
CHAT_COMPLETIONS_URL = "/v1/chat/completions"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: Literal[1] = 1
    stream: Literal[False] = False
    user: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("give one prompt (a string, or a list holding one string)")
        return value

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)


def _job(req: _Common, default_max_tokens: int | None, priority: Priority, **inputs: Any) -> JobRequest:
    fields: dict[str, Any] = dict(
        temperature=req.temperature, top_p=req.top_p, stop=req.stop_list(), seed=req.seed, priority=priority
    )
    max_tokens = req.max_tokens or default_max_tokens
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    return JobRequest(**inputs, **fields)


def job_request_for(url: str, body: dict[str, Any], priority: Priority = Priority.DEFAULT) -> JobRequest:
    """The job for an OpenAI-style request body at `url`; raises pydantic's ValidationError or ValueError."""
    if url == COMPLETIONS_URL:
        completion = CompletionRequest.model_validate(body)
        return _job(completion, COMPLETIONS_DEFAULT_MAX_TOKENS, priority, prompt=completion.prompt_text())
    if url == CHAT_COMPLETIONS_URL:
        chat = ChatCompletionRequest.model_validate(body)
        return _job(chat, None, priority, messages=chat.messages)
    raise ValueError(f"no OpenAI translation for {url}")


def model_of(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    return model if isinstance(model, str) else None


def _finish_reason(job: Job) -> str | None:
    reason = job.output.finish_reason if job.output else None
    return "length" if reason == "length" else ("stop" if reason else None)


def _usage(job: Job) -> dict[str, int]:
    prompt = job.usage.prompt_tokens or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": job.usage.completion_tokens,
        "total_tokens": prompt + job.usage.completion_tokens,
    }


def completion_response(job: Job, model: str) -> dict[str, Any]:
    """The `text_completion` object of a finished job."""
    return {
        "id": f"cmpl-{job.id}",
        "object": "text_completion",
        "created": int(job.created_at),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": job.output.text if job.output else "",
                "logprobs": None,
                "finish_reason": _finish_reason(job),
            }
        ],
        "usage": _usage(job),
    }


def chat_completion_response(job: Job, model: str) -> dict[str, Any]:
    """The `chat.completion` object of a finished job."""
    return {
        "id": f"chatcmpl-{job.id}",
        "object": "chat.completion",
        "created": int(job.created_at),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": job.output.text if job.output else ""},
                "logprobs": None,
                "finish_reason": _finish_reason(job),
            }
        ],
        "usage": _usage(job),
    }


def response_body(url: str, job: Job, model: str) -> dict[str, Any]:
    """What the endpoint at `url` answers for a finished job (the job itself for /v1/jobs)."""
    if url == COMPLETIONS_URL:
        return completion_response(job, model)
    if url == CHAT_COMPLETIONS_URL:
        return chat_completion_response(job, model)
    return job.model_dump(mode="json")


__all__ = ["ValidationError", "job_request_for", "response_body", "model_of"]
