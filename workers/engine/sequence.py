"""A request inside the engine: its tokens, KV bookkeeping, status and per-request state."""

import enum
import time
from dataclasses import dataclass, field

import torch

from workers.engine.detokenizer import Detokenizer
from workers.engine.grammar import GrammarMatcher
from workers.engine.outputs import TokenLogprob
from workers.engine.sampling_params import SamplingParams
from workers.spec.state import SpecState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted (its KV was freed; recomputed on readmission)
    RUNNING = "running"  # holds KV blocks; prefilling in chunks or decoding
    FINISHED = "finished"


# legal moves; the scheduler is the only place that changes status
TRANSITIONS = {
    SequenceStatus.WAITING: {SequenceStatus.RUNNING, SequenceStatus.FINISHED},
    SequenceStatus.RUNNING: {SequenceStatus.WAITING, SequenceStatus.FINISHED},
    SequenceStatus.FINISHED: set(),
}


@dataclass
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by every output token so far
    num_prompt_tokens: int
    params: SamplingParams
    detokenizer: Detokenizer
    generator: torch.Generator | None  # per-request RNG for sampling; None when greedy
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the target cache
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    arrival_time_s: float = field(default_factory=time.perf_counter)
    first_scheduled_time_s: float | None = None
    first_token_time_s: float | None = None
    num_preemptions: int = 0
    priority: int = 0  # lower = more urgent (workers/engine/priority.py); the worker's queue, as a number
    spec: SpecState | None = None  # speculation state; None = plain decoding
    # [num_prompt_tokens - 1 at most] the target's logprob of prompt tokens 1.. (params.prompt_logprobs)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    is_prompt_logprobs_sent: bool = False  # a StepOutput carried them
    grammar: GrammarMatcher | None = None  # structured output: the grammar of its output; None = free text
    # prefix caching (workers/engine/block_manager.py, prefix_cache.py)
    block_keys: list[bytes] = field(default_factory=list)  # the keys of its first full blocks of tokens
    num_registered_blocks: int = 0  # leading blocks of its table that are registered (or were claimed)
    num_proposer_blocks: int = 0  # of those, the leading ones marked as holding its proposer's rows
    num_cached_tokens: int = 0  # prompt tokens its first admission took from the cache

    def drop_kv(self) -> None:
        """Forget every cached K/V (preemption): target and draft recompute from the start."""
        self.num_computed_tokens = 0
        if self.spec is not None:
            self.spec.drop_kv()

    @property
    def drafts_chains_only(self) -> bool:
        """Whether each verified row depends on the draft tokens before it in order (its grammar's state, its
        penalties' counts, its position while min_tokens holds stop tokens back): such a sequence drafts chains,
        never trees."""
        return self.grammar is not None or self.params.has_penalties or self.holds_stop_tokens

    @property
    def holds_stop_tokens(self) -> bool:
        """min_tokens: its output is still too short to stop (workers/engine/min_tokens.py)."""
        return self.params.min_tokens > self.num_output_so_far

    @property
    def output_start(self) -> int:
        """Where the output starts in token_ids: a resumed job's prompt ends with the output it already had."""
        return self.num_prompt_tokens - self.params.num_resumed_tokens

    @property
    def num_output_so_far(self) -> int:
        """The output's tokens, a resumed job's earlier ones included (num_output_tokens counts this run's)."""
        return len(self.token_ids) - self.output_start

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def move_to(self, status: SequenceStatus) -> None:
        if status not in TRANSITIONS[self.status]:
            raise RuntimeError(f"{self.request_id}: illegal transition {self.status.value} -> {status.value}")
        self.status = status
