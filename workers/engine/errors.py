"""Typed engine errors: the gateway maps InvalidRequestError to 4xx (PromptTooLongError to 413)."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError):
    """A request the engine refuses; `field` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class PromptTooLongError(InvalidRequestError):
    """The prompt (or prompt + max_tokens) does not fit the model's context or the KV budget."""
