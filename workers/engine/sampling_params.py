"""Per-request sampling settings and their validation."""

from dataclasses import dataclass, field

from shared.schemas import MAX_REPETITION_PENALTY, MAX_SEED, MAX_TOP_K, MIN_SEED
from shared.speculation import SpeculativeMethod
from workers.engine.errors import InvalidRequestError

MIN_SAMPLING_TEMPERATURE = 1e-5  # a temperature below this decodes greedily


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0  # in [0, 1]: vLLM's, a token less likely than min_p x the likeliest is dropped; 0 = off
    seed: int | None = None  # per-request generator: reproducible whatever the batch
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # vLLM's: the output ends with the stop string it met
    skip_special_tokens: bool = True  # vLLM's: False leaves special tokens' text (EOS, chat markers) in the output
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None = the engine's default; validate() turns a plain string ("draft", "ngram", "none") into the enum
    speculative: SpeculativeMethod | None = None
    # the target's log-probabilities (workers/engine/logprobs.py): None = off; N = each token's own and its N
    # most likely alternatives, of every output token (logprobs) and every prompt token but the first (prompt_)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # structured output: llguidance's grammar (shared/response_format.py grammar_of); None = free text
    grammar: str | None = None
    # a job resumed elsewhere: its last num_resumed_tokens prompt tokens are output the grammar already consumed
    num_resumed_tokens: int = 0
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit (workers/engine/logit_bias.py);
    # the engine checks it against its vocabulary in add_request
    logit_bias: dict[int, float] | None = None
    # vLLM's: sample only among these token ids (workers/engine/allowed_tokens.py); None = every token
    allowed_token_ids: list[int] | None = None
    # vLLM's: the prefix cache shares blocks only among requests with the same salt (workers/engine/prefix_cache.py)
    cache_salt: str | None = None
    # OpenAI's penalties on tokens the output already has, and vLLM's on tokens of the prompt or output
    # (workers/engine/penalties.py): 0, 0 and 1 are off
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    repetition_penalty: float = 1.0  # in (0, MAX_REPETITION_PENALTY]
    # vLLM's: no EOS, stop_token_ids nor stop string before the output has this many tokens (min_tokens.py; apply.py)
    min_tokens: int = 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_seeded_sampling(self) -> bool:
        """Sampled from its own seed: its draws, and so its speculation lengths, must not depend on timing or on
        other requests (workers/spec/adaptive.py)."""
        return self.seed is not None and not self.is_greedy

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or not self.temperature >= 0.0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature!r}")
        if self.temperature < MIN_SAMPLING_TEMPERATURE:  # as vLLM: the logits over it overflow float32 (1e-40
            self.temperature = 0.0  # gave NaN probabilities and token 0); its distribution is the argmax anyway
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, int | float) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        # a value out of these ranges would fail in a later step's tensors and take the engine with it
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequestError("top_k", f"must be -1 (off) or an integer in [0, 2**63 - 1], got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not MIN_SEED <= self.seed <= MAX_SEED
        ):
            raise InvalidRequestError("seed", f"must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must not be empty")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= 256):
            raise InvalidRequestError("cache_salt", "must be a string of 1 to 256 characters (or null)")
        if not isinstance(self.skip_special_tokens, bool):
            raise InvalidRequestError("skip_special_tokens", "must be true or false")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidRequestError("include_stop_str_in_output", "must be true or false")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("stop_token_ids", "must be a list of integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 20):
                raise InvalidRequestError(name, f"must be an integer in [0, 20] (or null), got {value!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidRequestError("response_format", "the grammar must be a string")
        if isinstance(self.num_resumed_tokens, bool) or not isinstance(self.num_resumed_tokens, int) or (
            self.num_resumed_tokens < 0
        ):
            raise InvalidRequestError("num_resumed_tokens", f"must be an integer >= 0, got {self.num_resumed_tokens!r}")
        for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
                raise InvalidRequestError(name, f"must be a number in [{low:g}, {high:g}], got {value!r}")
        value = self.repetition_penalty
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {value!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or (
            not 0 <= self.min_tokens <= self.max_tokens + self.num_resumed_tokens
        ):
            raise InvalidRequestError("min_tokens", f"must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.speculative is not None:
            choices = [m.value for m in SpeculativeMethod]
            if not isinstance(self.speculative, str) or self.speculative not in choices:
                raise InvalidRequestError("speculative", f"must be one of {choices}, got {self.speculative!r}")
            self.speculative = SpeculativeMethod(self.speculative)
