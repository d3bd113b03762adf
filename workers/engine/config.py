"""EngineConfig: the engine's settings and their one set of defaults (the fields below).

Precedence (highest first): explicit overrides (CLI flags) > environment (`SPECFLEET_ENGINE_<FIELD>`) >
the YAML file's `engine:` section (configs/engine.yaml, overrides only) > the defaults here. Values from the
environment and the file are validated and converted by pydantic like any other; an unknown key in the file
or in the overrides is an error, never silently ignored.
"""

import dataclasses
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass

from shared.speculation import SpeculativeMethod
from workers.engine.compile_stats import CompileMode
from workers.engine.fusing import FusingMode
from workers.engine.native_build import NativeBuild
from workers.engine.packing import PackingMode
from workers.engine.small_pass_threads import SmallPassThreads
from workers.models.device import DEVICE_PATTERN

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "configs" / "engine.yaml"
ENV_PREFIX = "SPECFLEET_ENGINE_"
FILE_SECTION = "engine"

Dtype = Literal["auto", "float32", "bfloat16", "float16", "float64"]
AttentionBackend = Literal["native", "sdpa"]


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class EngineConfig:
    target_dir: str | None = None  # HF checkpoint dir; None = the demo pair (resolved by the caller, built if missing)
    draft_dir: str | None = None  # None = the demo pair's draft when target_dir is None
    eagle_dir: str | None = None  # an EAGLE head for the target (workers/models/eagle_head.py); None = no head
    dtype: Dtype = "auto"  # auto: bf16 where the CPU/GPU does it fast (AVX-512/AMX, CUDA), else fp32
    # where the models and their KV caches live (workers/models/device.py): auto = the first CUDA device where
    # one is visible, else the CPU; cpu; cuda or cuda:N. Scheduling, sampling and speculation stay on the CPU
    device: Annotated[str, Field(pattern=DEVICE_PATTERN.pattern)] = "auto"
    # on a CUDA device: plain decode passes of the target and the draft replay CUDA graphs captured at start-up
    # for each bucket of batch size and context (workers/engine/decode_graphs.py); False = op by op
    cuda_graphs: bool = True
    # the longest context a decode graph spans (vLLM's max_seq_len_to_capture): a graph gathers every key of
    # its width for each of its rows, so wider graphs would hold gathers of many GB; longer sequences decode
    # op by op
    cuda_graph_max_context: PositiveInt = 8192
    num_threads: NonNegativeInt = 0  # torch threads for large passes; 0 = every core this process may use
    # passes of at most this many tokens (batch-1 decode, draft tokens) run on one thread (but see
    # small_pass_threads): op by op they are memory-bound, and a 2nd thread only adds sync, and stalls when another
    # process holds a core
    single_thread_max_tokens: NonNegativeInt = 4
    # those small passes, for a model whose passes take the native layers (fused_layers): `auto` = on all
    # num_threads where timed passes of 1 and single_thread_max_tokens tokens were faster so on this host
    # (workers/engine/small_pass_threads.py); `all`; `one` = on one thread
    small_pass_threads: SmallPassThreads = SmallPassThreads.AUTO
    block_size: PositiveInt = 16  # tokens per KV block
    kv_cache_mb: PositiveFloat = 256.0  # KV budget for target + draft caches
    # automatic prefix caching (workers/engine/prefix_cache.py): a request whose first full blocks of tokens a
    # finished or running one computed takes their KV instead of computing it (a chat's next turn, a shared
    # system prompt, `n` choices); False = every prompt is computed whole
    prefix_caching: bool = True
    max_num_seqs: PositiveInt = 32  # sequences running at once
    max_num_batched_tokens: PositiveInt = 512  # tokens per forward (prefill chunks + decodes)
    max_model_len: NonNegativeInt = 0  # 0 = the target's max_position_embeddings
    # priorities (workers/engine/priority.py; lower = more urgent): a request may be preempted for a more urgent
    # one this many times at most (0 = never); priority -> share of slots and KV kept for it and more urgent ones
    priority_preemption_limit: NonNegativeInt = 4
    priority_reserved_fraction: dict[NonNegativeInt, Annotated[float, Field(ge=0, le=1)]] = Field(default_factory=dict)
    # torch.compile of the dense path (workers/engine/compilation.py), at start-up: `auto` = where it measured
    # faster on this host; off by default: the first start compiles for tens of seconds (cached afterwards)
    compile: CompileMode = CompileMode.OFF
    compile_cache_dir: str | None = None  # compiled artifacts; None = $SPECFLEET_HOME/compile-cache
    # Engine.warm_pass_shapes (the worker's warm-up, the benchmarks): every runner runs one pass of each token
    # count up to this many, so oneDNN's per-shape set-up is paid before requests; None = max_num_seqs x (1 +
    # num_speculative_tokens), at most max_num_batched_tokens; 0 = none
    warm_pass_tokens: NonNegativeInt | None = None
    # paged attention (workers/models/attention.py): `native` = one kernel call per layer, built with the host's
    # C++ compiler at start-up (cached under compile_cache_dir; SDPA where it can't be built, and for token trees
    # and float16); `sdpa` = PyTorch ops only
    attention_backend: AttentionBackend = "native"
    # linear weights prepacked for oneDNN at start-up (workers/models/packed_linear.py): `auto` = for bfloat16 models,
    # where a timed one-token pass was faster and bit-identical; `on` = every float32/bfloat16 CPU model (bfloat16
    # where the CPU has oneDNN's bfloat16 path); `off`.
    # A packed copy sits beside each weight (more memory)
    linear_packing: PackingMode = PackingMode.AUTO
    # passes through the model's decoder layers as one native call (workers/models/fused_decode.py; CPU float32 or
    # bfloat16, needs the native attention kernel): `auto` = passes up to the largest size where timed passes of 1,
    # the single-thread limit, then doubling, were faster on this host and chose the same tokens
    # (workers/engine/fusing.py); `on` = every pass; `off`
    fused_layers: FusingMode = FusingMode.AUTO
    # how the native kernels' linear layers sum bfloat16 weights on a CPU with AVX512-BF16 (workers/engine/
    # native_build.py): `host` = the library built for this CPU (its bfloat16 dot instruction, AMX tiles);
    # `portable` = built without them (weights widened to float32, FMA); `auto` = the build whose timed target
    # passes of 1, 2, 4 .. max_num_seqs tokens were faster on this host and chose the same tokens (kept under
    # compile_cache_dir: later engines of the model on this host take the same build)
    native_build: NativeBuild = NativeBuild.AUTO
    # the target sharded over this many ranks (processes) of the worker: rank 0 is the engine's own process
    # (scheduler, draft, sampler); ranks 1..N-1 are spawned (workers/engine/tp_runner.py). kv_cache_mb is per rank
    tensor_parallel_size: PositiveInt = 1
    seed: int = 0  # seeds the RNG that unseeded sampling requests draw their generators from
    # speculative decoding (workers/spec/)
    # the method of requests that do not choose; None = the best the engine holds: the EAGLE head when it has
    # one (bench spec: 1.5x the draft model at batch 1 on the demo pair), else the draft model, else ngram
    speculative_method: SpeculativeMethod | None = None
    num_speculative_tokens: PositiveInt = 8  # k at most (chain): measured costs pick 0..k a step (seeded: k_min..k)
    speculative_k_min: PositiveInt = 1
    is_adaptive: bool = True  # False: every speculating sequence uses num_speculative_tokens
    tree_size: NonNegativeInt = 0  # > 0: the draft model (or EAGLE head) proposes a token tree of up to tree_size nodes
    tree_branching: PositiveInt = 2  # children per tree node at most
    ngram_min_n: PositiveInt = 1
    ngram_max_n: PositiveInt = 4
    # lengths come from pass costs measured at run time (workers/spec/length_policy.py), except for seeded
    # sampling requests, whose draws must not depend on timing: their k weighs acceptance against this
    # nominal cost of one more draft token, in target decode steps
    spec_draft_cost_per_token: PositiveFloat = 0.15
    spec_fallback_acceptance: Annotated[float, Field(ge=0, le=1)] = 0.15  # below this for `patience` steps: plain
    spec_fallback_patience_steps: PositiveInt = 16

    @field_validator("priority_reserved_fraction", mode="before")
    @classmethod
    def _reserved_from_text(cls, value: Any) -> Any:
        """The environment gives text: a JSON object, e.g. SPECFLEET_ENGINE_PRIORITY_RESERVED_FRACTION='{"0": 0.25}'."""
        return json.loads(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _ranges(self) -> "EngineConfig":
        if self.speculative_k_min > self.num_speculative_tokens:
            raise ValueError("need speculative_k_min <= num_speculative_tokens")
        if self.ngram_min_n > self.ngram_max_n:
            raise ValueError("need ngram_min_n <= ngram_max_n")
        if self.tensor_parallel_size > 1 and self.compile is not CompileMode.OFF:
            raise ValueError("compile runs one process's dense path: with tensor_parallel_size > 1 set compile: off")
        if sum(self.priority_reserved_fraction.values()) > 1:
            raise ValueError("priority_reserved_fraction: the shares add up to more than 1")
        return self

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> "EngineConfig":
        """The file's `engine:` section, then SPECFLEET_ENGINE_<FIELD> environment variables, then the
        overrides that are not None (CLI flags). Raises pydantic's ValidationError naming a bad field."""
        values = file_values(Path(path) if path is not None else DEFAULT_PATH)
        values.update(env_values())
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def file_values(path: Path) -> dict[str, Any]:
    """The `engine:` section of a YAML file ({} when the file is missing or the section is empty)."""
    if not path.exists():
        return {}
    document = yaml.safe_load(path.read_text()) or {}
    if not isinstance(document, dict) or set(document) - {FILE_SECTION}:
        raise ValueError(f"{path}: expected one top-level key, {FILE_SECTION!r}")
    return dict(document.get(FILE_SECTION) or {})


def env_values() -> dict[str, str | None]:
    """SPECFLEET_ENGINE_<FIELD> variables; an empty value means None (e.g. no target dir)."""
    values: dict[str, str | None] = {}
    for name in EngineConfig.field_names():
        text = os.environ.get(ENV_PREFIX + name.upper())
        if text is not None:
            values[name] = text or None
    return values
