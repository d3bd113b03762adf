"""413 at submit for a prompt beyond the model's context (422 for a token id beyond its vocabulary, in the
prompt, `logit_bias` or `stop_token_ids`).

Workers publish the model's `max_model_len`, vocabulary size and tokenizer path in Redis (keys.MODEL_INFO); the
gateway reads that every few seconds and counts tokens with the `tokenizers` library (as the engine does: no
special tokens) only when the prompt's UTF-8 byte count could exceed the context (a byte-level BPE never makes
more tokens than bytes); a tokenized prompt (`prompt_token_ids`) is its own count. The rule is the engine's:
prompt tokens + max_tokens must fit max_model_len. Without model information the worker still refuses the job
(`failed`, code `prompt_too_long` or `invalid_request`).
"""

import asyncio
import logging
import time
from pathlib import Path

from redis.asyncio import Redis

from gateway.errors import ApiError
from shared import keys
from shared.job_state import ErrorCode
from shared.schemas import JobRequest

log = logging.getLogger(__name__)

SPECIAL_TOKENS_MARGIN = 16  # BOS/EOS and chat-template tokens the byte bound does not see


class PromptLimit:
    def __init__(self, redis: Redis, refresh_s: float) -> None:
        self.redis = redis
        self.refresh_s = refresh_s
        self._max_model_len: int | None = None
        self._vocab_size: int | None = None  # a prompt's token ids must be below it (the engine's rule)
        self._tokenizer_path = ""
        self._tokenizer: object | None = None
        self._unusable_path = ""  # a tokenizer path that failed to load (not retried)
        self._fetched_at = -float("inf")

    async def _refresh(self) -> None:
        if time.monotonic() - self._fetched_at < self.refresh_s:
            return
        self._fetched_at = time.monotonic()
        info: dict[str, str] = await self.redis.hgetall(keys.MODEL_INFO)  # type: ignore[assignment]
        self._max_model_len = int(info["max_model_len"]) if info.get("max_model_len") else None
        self._vocab_size = int(info["vocab_size"]) if info.get("vocab_size") else None
        path = info.get("tokenizer_path", "")
        if path != self._tokenizer_path and path != self._unusable_path:
            self._tokenizer_path, self._tokenizer = path, None

    def _check_token_ids(self, request: JobRequest, token_ids: list[int]) -> None:
        """A tokenized prompt: each id in the vocabulary (422), and its length the engine's rule (413)."""
        if self._vocab_size is not None and (largest := max(token_ids)) >= self._vocab_size:
            raise ApiError(
                422,
                ErrorCode.INVALID_REQUEST,
                f"prompt_token_ids: token id {largest} is not in the model's vocabulary of {self._vocab_size}",
                field="prompt_token_ids",
            )
        if self._max_model_len is not None and len(token_ids) + request.max_tokens > self._max_model_len:
            field = "prompt_token_ids" if len(token_ids) >= self._max_model_len else "max_tokens"
            raise ApiError(
                413,
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt ({len(token_ids)} tokens) + max_tokens ({request.max_tokens}) exceeds the model's context "
                f"of {self._max_model_len} tokens",
                field=field,
            )

    def _count_tokens(self, text: str) -> int | None:
        if self._tokenizer is None and self._tokenizer_path:
            tokenizer_file = Path(self._tokenizer_path) / "tokenizer.json"
            try:
                from tokenizers import Tokenizer

                self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
            except Exception as exc:  # a missing or foreign tokenizer leaves the check to the worker
                log.warning(
                    "cannot load tokenizer %s: %s; prompt lengths are left to the worker", tokenizer_file, exc
                )
                self._unusable_path, self._tokenizer_path = self._tokenizer_path, ""
        if self._tokenizer is None:
            return None
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)  # type: ignore[attr-defined]

    async def check(self, request: JobRequest) -> None:
        """Raise 413 when prompt tokens + max_tokens exceed max_model_len (the engine's own rule), 422 for a token
        id past the vocabulary."""
        await self._refresh()
        for name, ids in (("logit_bias", list(request.logit_bias or ())), ("stop_token_ids", request.stop_token_ids),
                          ("allowed_token_ids", request.allowed_token_ids or [])):  # fmt: skip
            if ids and self._vocab_size is not None and (largest := max(ids)) >= self._vocab_size:
                raise ApiError(
                    422,
                    ErrorCode.INVALID_REQUEST,
                    f"{name}: token id {largest} is not in the model's vocabulary of {self._vocab_size}",
                    field=name,
                )
        if request.prompt_token_ids is not None:
            self._check_token_ids(request, request.prompt_token_ids)
            return
        if self._max_model_len is None:
            return
        messages = request.messages or []
        text = request.prompt if request.prompt is not None else "\n".join(m.content for m in messages)
        if len(text.encode()) + SPECIAL_TOKENS_MARGIN + request.max_tokens <= self._max_model_len:
            return
        num_tokens = await asyncio.to_thread(self._count_tokens, text)
        if num_tokens is None or num_tokens + request.max_tokens <= self._max_model_len:
            return
        field = "max_tokens"
        if num_tokens >= self._max_model_len:
            field = "messages" if request.prompt is None else "prompt"
        raise ApiError(
            413,
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt ({num_tokens} tokens) + max_tokens ({request.max_tokens}) exceeds the model's context of "
            f"{self._max_model_len} tokens",
            field=field,
        )
