"""Logprobs and `echo` on OpenAI streams: what each chunk of a `/v1/completions` or `/v1/chat/completions`
stream carries besides its text (gateway/openai_api.py writes the chunks).

Each token event of a job that asked for logprobs carries its tokens' logprobs (workers/worker/logprobs.py); a
chunk gets those of its event. A completion with `echo` starts with a chunk holding the prompt: at once without
logprobs, or, with them, when the first token event brings the prompt's logprobs.
"""

from shared import openai_compat as oa
from shared.openai_logprobs import ChatLogprobs, CompletionLogprobs, chat_logprobs, completion_logprobs
from shared.schemas import TokenEvent


class StreamLogprobs:
    def __init__(self, body: oa.CompletionRequest | oa.ChatCompletionRequest) -> None:
        self.is_chat = isinstance(body, oa.ChatCompletionRequest)
        self.wants_logprobs = bool(body.logprobs is not None and body.logprobs is not False)
        self.echo = isinstance(body, oa.CompletionRequest) and bool(body.echo)
        # echoed as given; a prompt of token ids: its tokens' texts, with the prompt's logprobs (echoed_prompt)
        self.echo_prompt = body.prompt_text() if isinstance(body, oa.CompletionRequest) and body.echo else None
        self.text_offset = 0  # completions: where the next chunk's tokens start in the whole text

    def opening_echo(self) -> str | None:
        """The prompt, to send before any token, when it is echoed without logprobs."""
        if self.echo_prompt is None or self.wants_logprobs:
            return None
        self.text_offset = len(self.echo_prompt)
        return self.echo_prompt

    def echo_with_logprobs(self, token: TokenEvent) -> tuple[str, CompletionLogprobs] | None:
        """(the prompt, its logprobs) once the event that carries them arrives."""
        if not self.echo or token.prompt_logprobs is None:
            return None
        logprobs = completion_logprobs(token.prompt_logprobs, self.text_offset)
        self.text_offset += sum(len(t.token) for t in token.prompt_logprobs)
        text = self.echo_prompt if self.echo_prompt is not None else "".join(t.token for t in token.prompt_logprobs)
        return text, logprobs

    def of(self, token: TokenEvent) -> CompletionLogprobs | ChatLogprobs | None:
        """The logprobs of one token event's tokens, in the stream's shape (None when not asked)."""
        if token.logprobs is None:
            return None
        if self.is_chat:
            return chat_logprobs(token.logprobs)
        logprobs = completion_logprobs(token.logprobs, self.text_offset)
        self.text_offset += sum(len(t.token) for t in token.logprobs)  # as completion_logprobs counts
        return logprobs
