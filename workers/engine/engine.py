"""The engine: add requests, step, abort. No Redis here; the worker process drives it.

step() reads like the data flow: schedule (a typed plan) -> propose draft tokens -> run the target once (its
features too, when an EAGLE sequence is in the batch) -> verify -> apply (append, detokenize, stop checks; workers/engine/apply.py is the one writer of sequence
state) -> retire finished sequences -> return what changed.
"""

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from shared.home import specfleet_home
from shared.speculation import SpeculativeMethod
from workers.engine.allowed_tokens import check_allowed_tokens
from workers.engine.apply import StepApplier
from workers.engine.block_manager import BlockManager
from workers.engine.compilation import compile_runner, point_cache_at
from workers.engine.compile_stats import CompileMode, CompileStats
from workers.engine.config import EngineConfig
from workers.engine.cost_probe import probe, probe_attention, probe_sizes
from workers.engine.decode_graphs import GraphShape, graphs_for
from workers.engine.detokenizer import Detokenizer, make_decode_fn
from workers.engine.draft_proposer import DraftProposer
from workers.engine.eagle_proposer import EagleProposer
from workers.engine.encoding import make_encode_fn
from workers.engine.errors import InvalidRequestError, PromptTooLongError
from workers.engine.feature_store import FeatureStore
from workers.engine.fusing import FusingStats, fuse_runner
from workers.engine.grammar import GrammarCompiler, GrammarMatcher
from workers.engine.head_runner import HeadRunner
from workers.engine.logit_bias import check_logit_bias
from workers.engine.logprobs import StepLogits, verify_rows, widen
from workers.engine.min_tokens import stop_token_set
from workers.engine.model_runner import ForwardItem, ModelRunner, ThreadPolicy, warm_items
from workers.engine.native_build import BuildChoice, choose_build
from workers.engine.outputs import StepOutput, TokenLogprob
from workers.engine.packing import PackingStats, pack_model
from workers.engine.priority import PriorityPolicy
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from workers.engine.sequence import Sequence
from workers.engine.small_pass_threads import ThreadChoice, choose_threads
from workers.engine.speculator import Speculator
from workers.engine.target_logits import processed_logits, reads_only_raw_logits
from workers.engine.tp_runner import load_target, make_runner
from workers.models import native_attention
from workers.models.device import resolve_device, to_host
from workers.models.eagle_head import load_head
from workers.models.loader import check_checkpoint_dir, load_model, load_tokenizer, resolve_dtype
from workers.models.native_attention import NativeAttention
from workers.spec.proposal import Proposal, Verdict
from workers.spec.row_max import torch_row_max
from workers.spec.verify_batch import VerifyEntry, reads_argmax_only

log = logging.getLogger(__name__)


def default_method(cfg: EngineConfig, draft_dir: Path | None, eagle_dir: Path | None) -> SpeculativeMethod:
    """cfg's speculative_method, or when it names none the best the engine holds: head, draft model, ngram."""
    if cfg.speculative_method is not None:
        return cfg.speculative_method
    if eagle_dir is not None:
        return SpeculativeMethod.EAGLE
    return SpeculativeMethod.DRAFT if draft_dir is not None else SpeculativeMethod.NGRAM


class Engine:
    def __init__(
        self, cfg: EngineConfig, target_dir: Path, draft_dir: Path | None = None, eagle_dir: Path | None = None
    ) -> None:
        for role, model_dir in (("target", target_dir), ("draft", draft_dir), ("EAGLE head", eagle_dir)):
            if model_dir is not None:
                check_checkpoint_dir(model_dir, role)
        cfg = dataclasses.replace(cfg, speculative_method=default_method(cfg, draft_dir, eagle_dir))
        self.cfg = cfg
        num_threads = cfg.num_threads or max(1, len(os.sched_getaffinity(0)) // cfg.tensor_parallel_size)
        threads = ThreadPolicy(num_threads, cfg.single_thread_max_tokens)
        torch.set_num_threads(threads.num_threads)
        self.tokenizer = load_tokenizer(target_dir)
        self._encode = make_encode_fn(self.tokenizer)  # a prompt's ids, as tokenizer.encode gives them
        self._decode = make_decode_fn(self.tokenizer)
        self._decode_special = make_decode_fn(self.tokenizer, skip_special_tokens=False)  # skip_special_tokens off
        dtype, self.device = resolve_dtype(cfg.dtype), resolve_device(cfg.device)
        # TP > 1: rank 0's shard; the other ranks' processes are up, closed by close() (or if start-up fails)
        model, self.tp_group = load_target(cfg, target_dir, dtype, threads, self.device)
        if self.tp_group is not None:
            weakref.finalize(self, self.tp_group.close)
        self.max_model_len = cfg.max_model_len or model.cfg.max_position_embeddings
        draft = load_model(draft_dir, dtype, self.max_model_len, self.device) if draft_dir is not None else None
        if draft is None and cfg.speculative_method is SpeculativeMethod.DRAFT:
            raise ValueError("speculative_method is draft but there is no draft model: give one, or choose ngram or none")
        if draft is not None and draft.cfg.vocab_size != model.cfg.vocab_size:
            raise ValueError(f"draft vocab {draft.cfg.vocab_size} != target vocab {model.cfg.vocab_size}")
        if cfg.speculative_method is SpeculativeMethod.EAGLE and eagle_dir is None:
            raise ValueError("speculative_method is eagle but there is no EAGLE head (eagle_dir): give one, or choose ngram or none")
        head = load_head(eagle_dir, model) if eagle_dir is not None else None  # HeadMismatchError names a mismatch
        bytes_per_block = ModelRunner.kv_bytes_per_block(model, cfg.block_size)
        if draft is not None:
            bytes_per_block += ModelRunner.kv_bytes_per_block(draft, cfg.block_size)
        is_feature_store = head is not None and cfg.prefix_caching  # the target's features of cached blocks
        if head is not None:
            bytes_per_block += HeadRunner.kv_bytes_per_block(head, cfg.block_size)
        if is_feature_store:
            bytes_per_block += FeatureStore.bytes_per_block(cfg.block_size, model.cfg.hidden_size, dtype)
        num_blocks = int(cfg.kv_cache_mb * 2**20 // bytes_per_block)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_mb={cfg.kv_cache_mb} holds fewer than 2 blocks")
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.prefix_caching)
        if is_feature_store:
            self.block_manager.features = FeatureStore(num_blocks, cfg.block_size, model.cfg.hidden_size, dtype, self.device)
        # one cache block past the manager's, never handed out: where decode graphs' padding rows write
        num_cache_blocks = num_blocks + 1
        self.runner = make_runner(model, num_cache_blocks, cfg.block_size, threads, self.tp_group)
        native = native_attention.load(self.compile_cache_dir / "native") if cfg.attention_backend == "native" else None
        self.native_build: BuildChoice | None = None  # none: no native kernels
        if native is not None and self.tp_group is None and self.device.type == "cpu":  # the build its runners use
            native, self.native_build = choose_build(
                self.runner, native, cfg.native_build, dtype, self.compile_cache_dir / "native", cfg.max_num_seqs,
                repr(model.cfg),
            )
        row_max = native.row_max if native is not None else torch_row_max  # greedy tokens: each row's max, argmax
        eos_ids = frozenset(model.cfg.eos_token_ids)  # min_tokens holds them back in drafts too
        draft_proposer = (
            DraftProposer(ModelRunner(draft, num_cache_blocks, cfg.block_size, threads), row_max, eos_ids)
            if draft is not None
            else None
        )
        eagle = (
            EagleProposer(HeadRunner(head, num_cache_blocks, cfg.block_size, threads), row_max, eos_ids)
            if head is not None
            else None
        )
        self._use_native_attention(native, draft_proposer, eagle)
        self.packing = self._pack_linears(draft_proposer, eagle)
        self.compile_stats = self._compile(draft_proposer, eagle)
        self.fusing = self._fuse_layers(draft_proposer, eagle)
        self.small_pass_threads = self._choose_threads(draft_proposer, eagle)
        self.speculator = Speculator(cfg, draft_proposer, self.max_model_len, eagle, row_max)
        is_graphed = self.device.type == "cuda" and cfg.cuda_graphs
        self.graph_capture_s: dict[str, float] = {}  # model -> its decode graphs' capture seconds
        if is_graphed:
            self.use_decode_graphs(capture=True)
        self._measure_costs(draft_proposer.runner if draft_proposer is not None else None)
        self.applier = StepApplier(
            self.runner, self.speculator.stats, cfg.is_adaptive, frozenset(model.cfg.eos_token_ids), self.max_model_len,
            cfg.block_size if is_feature_store else 0,
        )  # fmt: skip
        policy = PriorityPolicy(
            cfg.max_num_seqs, num_blocks, cfg.priority_preemption_limit, cfg.priority_reserved_fraction
        )
        self.scheduler = Scheduler(
            self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.speculator.plan_lookahead, policy
        )
        self._grammar_compiler: GrammarCompiler | None = None  # built on the first constrained request
        self.sequences: dict[str, Sequence] = {}
        self.last_plan: SchedulerOutput | None = None  # the last step's plan (the worker splits cost by it)
        self._num_left_waiting = 0  # requests the last step's plan left waiting
        self._seed_rng = torch.Generator().manual_seed(cfg.seed)
        log.info("engine ready: %d KV blocks of %d tokens, max_model_len %d", num_blocks, cfg.block_size,
                 self.max_model_len)

    @property
    def compile_cache_dir(self) -> Path:
        cache_dir = self.cfg.compile_cache_dir
        return Path(cache_dir) if cache_dir else specfleet_home() / "compile-cache"

    def _use_native_attention(
        self, native: NativeAttention | None, draft: DraftProposer | None, eagle: EagleProposer | None
    ) -> None:
        """Hand every runner the native attention kernel (built or found cached where cfg.attention_backend
        says native); `native_attention` says which models it serves. The tensor-parallel target stays on SDPA:
        its ranks receive the SDPA path's metadata."""
        if self.tp_group is None:
            self.runner.use_native(native)
        self.native_attention = {"target": self.runner.native is not None}
        if draft is not None:
            draft.runner.use_native(native)
            self.native_attention["draft"] = draft.runner.native is not None
        if eagle is not None:
            eagle.runner.use_native(native)
            self.native_attention["eagle"] = eagle.runner.native is not None

    def _pack_linears(self, draft: DraftProposer | None, eagle: EagleProposer | None) -> dict[str, PackingStats]:
        """Prepack each model's linear weights where cfg.linear_packing says (packing.py), before compiling and
        timing anything, so both see the path requests will take. The tensor-parallel target is left as it is."""
        mode = self.cfg.linear_packing
        one_token = [ForwardItem([0], 0, [0], num_logits=1)]  # block 0: no sequence holds it at start-up
        stats = {}
        if self.tp_group is None:
            stats["target"] = pack_model(self.runner.model, lambda: self.runner.forward(one_token), mode, "target")
        if draft is not None:
            runner = draft.runner
            stats["draft"] = pack_model(runner.model, lambda: runner.forward(one_token), mode, "draft")
        if eagle is not None:
            head = eagle.runner
            stats["eagle"] = pack_model(head.head, lambda: head.probe_forward(one_token), mode, "eagle")
        return stats

    def _compile(self, draft: DraftProposer | None, eagle: EagleProposer | None) -> dict[str, CompileStats]:
        """Compile the target's, the draft's and the EAGLE head's dense paths now, before any request
        (cfg.compile)."""
        if self.cfg.compile is not CompileMode.OFF:
            point_cache_at(self.compile_cache_dir)
        stats = {"target": compile_runner(self.runner, self.cfg.compile, "target")}
        if draft is not None:
            stats["draft"] = compile_runner(draft.runner, self.cfg.compile, "draft")
        if eagle is not None:
            stats["eagle"] = compile_runner(eagle.runner, self.cfg.compile, "eagle")
        return stats

    def _fuse_layers(self, draft: DraftProposer | None, eagle: EagleProposer | None) -> dict[str, FusingStats]:
        """Choose whether each model and the EAGLE head run their passes through their native layers (all or
        none: cfg.fused_layers; fusing.py), after compiling, against the path requests would otherwise take. The
        tensor-parallel target is left as it is. No pass is larger than max_num_batched_tokens, and the timed
        passes write from position 0 into blocks 0.. (no sequence holds them yet): they fit the cache and the
        model's length."""
        cfg = self.cfg
        max_tokens = min(cfg.max_num_batched_tokens, self.block_manager.num_blocks * cfg.block_size, self.max_model_len)
        runners = self._local_runners(draft, eagle)
        return {name: fuse_runner(runner, cfg.fused_layers, name, max_tokens) for name, runner in runners.items()}

    def _choose_threads(self, draft: DraftProposer | None, eagle: EagleProposer | None) -> dict[str, ThreadChoice]:
        """Choose how many threads each model's small passes get (cfg.small_pass_threads; small_pass_threads.py),
        after fusing (the native layers are what make more threads pay) and before the pass costs. The
        tensor-parallel target keeps its ranks' policy."""
        cfg = self.cfg
        max_context = min(self.block_manager.num_blocks * cfg.block_size, self.max_model_len)
        runners = self._local_runners(draft, eagle)
        return {name: choose_threads(runner, cfg.small_pass_threads, name, max_context) for name, runner in runners.items()}

    def _local_runners(
        self, draft: DraftProposer | None, eagle: EagleProposer | None
    ) -> dict[str, ModelRunner | HeadRunner]:
        """The runners whose passes run in this process, by model: the target (unless it is tensor-parallel, its
        ranks' passes elsewhere), the draft and the EAGLE head where the engine has them."""
        runners: dict[str, ModelRunner | HeadRunner] = {}
        if self.tp_group is None:
            runners["target"] = self.runner
        if draft is not None:
            runners["draft"] = draft.runner
        if eagle is not None:
            runners["eagle"] = eagle.runner
        return runners

    def use_decode_graphs(self, capture: bool) -> dict[str, float]:
        """Serve the plain decode passes of the target and the draft, the EAGLE head's chain passes, and with
        speculation the verify, catch-up and tree-level passes (up to 1 + k tokens, or a tree's nodes, a
        sequence), from static decode graphs (workers/engine/decode_graphs.py): captured as CUDA graphs for
        `capture` (start-up, on a CUDA device, before the pass costs are timed, so the speculator's tables hold
        what requests will run), else their static passes run op by op (the CPU tests). A model whose capture
        fails decodes op by op, logged. Returns the capture seconds of each model captured."""
        cfg = self.cfg
        runners: dict[str, ModelRunner | HeadRunner] = {"target": self.runner}
        if self.speculator.draft is not None:
            runners["draft"] = self.speculator.draft.runner
        if self.speculator.eagle is not None:
            runners["eagle"] = self.speculator.eagle.runner
        shape = GraphShape(
            block_size=cfg.block_size,
            scratch_block=self.block_manager.num_blocks,  # the runners' caches hold one block past the manager's
            max_batch=cfg.max_num_seqs,
            max_blocks=-(-min(self.max_model_len, cfg.cuda_graph_max_context) // cfg.block_size),
            # a verify pass holds the last token and k drafts (or a tree's nodes) of each sequence; the draft's and
            # the head's catch-up and tree-level passes at most as many
            max_queries=(
                1 if cfg.speculative_method is SpeculativeMethod.NONE
                else 1 + max(cfg.num_speculative_tokens, cfg.tree_size)
            ),
            max_tokens=cfg.max_num_batched_tokens,
        )
        for name, runner in runners.items():
            try:
                graphs = graphs_for(runner, shape, capture)  # its static buffers live on the device too
                if capture:
                    graphs.capture_all()
            except Exception:
                log.exception("capturing the %s model's decode graphs failed: it decodes op by op", name)
                continue
            runner.graphs = graphs
            self.graph_capture_s[name] = graphs.capture_time_s
        return self.graph_capture_s

    def _measure_costs(self, draft_runner: ModelRunner | None) -> None:
        """Time the target's, the draft's and the head's passes now (cost_probe.py), then feed every later
        pass to the speculator's tables: speculation lengths follow this host's costs as they are."""
        costs, cfg = self.speculator, self.cfg
        num_cache_blocks = self.block_manager.num_blocks
        per_seq = 1 + cfg.num_speculative_tokens  # a verify pass: the last token + k drafts per sequence
        limits = (cfg.block_size, num_cache_blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        sizes = probe_sizes(cfg.max_num_batched_tokens)
        costs.target_costs.attention = probe_attention(self.runner.forward, *limits)
        probe(self.runner.forward, cfg.block_size, num_cache_blocks, costs.target_costs, sizes, per_seq)
        self.runner.on_pass = costs.observe_target_pass
        draft_sizes = probe_sizes(min(cfg.max_num_seqs, cfg.max_num_batched_tokens))  # one token per sequence
        if draft_runner is not None:
            table = costs.proposer_costs[SpeculativeMethod.DRAFT.value]
            table.attention = probe_attention(draft_runner.forward, *limits)
            probe(draft_runner.forward, cfg.block_size, num_cache_blocks, table, draft_sizes, 1)
            draft_runner.on_pass = costs.proposer_pass_observer(SpeculativeMethod.DRAFT)
        if costs.eagle is not None:
            head = costs.eagle.runner
            table = costs.proposer_costs[SpeculativeMethod.EAGLE.value]
            table.attention = probe_attention(head.probe_forward, *limits)
            probe(head.probe_forward, cfg.block_size, num_cache_blocks, table, draft_sizes, 1)
            head.on_pass = costs.proposer_pass_observer(SpeculativeMethod.EAGLE)

    def warm_pass_shapes(self) -> float:
        """Run every runner (target, draft, head) once at each token count up to cfg.warm_pass_tokens, with as
        many logits rows, so no request pays oneDNN's one-time set-up of a matmul shape (model_runner.ShapesRun):
        ~3-4 ms a new count on the demo target and as much on its draft, whose catch-up passes take a new count
        at almost every step where sequences rejoin drafting. Only while no sequence holds KV (its passes write
        blocks 0..). The passes count as each runner's first of their shape, so no cost table learns from
        them. Returns the seconds it took."""
        if self.num_unfinished():
            raise RuntimeError("warm_pass_shapes writes KV blocks no sequence may hold: run it before requests")
        cfg = self.cfg
        max_tokens = cfg.warm_pass_tokens
        if max_tokens is None:
            max_tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * (1 + cfg.num_speculative_tokens))
        max_tokens = min(max_tokens, self.block_manager.num_blocks * cfg.block_size)
        start_s = time.perf_counter()
        forwards: list[Callable[[list[ForwardItem]], object]] = [self.runner.forward]
        if self.speculator.draft is not None:
            forwards.append(self.speculator.draft.runner.forward)
        if self.speculator.eagle is not None:
            forwards.append(self.speculator.eagle.runner.probe_forward)
        for forward in forwards:
            for num_tokens in range(1, max_tokens + 1):
                forward(warm_items(num_tokens, cfg.block_size))
        seconds = time.perf_counter() - start_s
        log.info("warmed pass shapes of 1..%d tokens in %.1f s", max_tokens, seconds)
        return seconds

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Tokens that end a sequence (unless its request ignores EOS); the step's applier checks them."""
        return self.applier.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, token_ids: frozenset[int]) -> None:
        self.applier.eos_token_ids = token_ids

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "Engine":
        target_dir = cfg.target_dir
        if target_dir is not None:
            draft_dir = Path(cfg.draft_dir) if cfg.draft_dir else None
            eagle_dir = Path(cfg.eagle_dir) if cfg.eagle_dir else None
            return cls(cfg, Path(target_dir), draft_dir, eagle_dir)
        # the engine builds no model: the caller fills in the demo pair first (workers/demo/resolve.py)
        raise ValueError("EngineConfig.target_dir is not set (resolve the demo pair first: with_demo_pair)")

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with TP = 1). The engine cannot step afterwards."""
        if self.tp_group is not None:
            self.tp_group.close()

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> int:
        """Queue a request (`priority`: lower = more urgent, workers/engine/priority.py); returns its prompt
        length in tokens. Raises InvalidRequestError."""
        if request_id in self.sequences:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
            raise InvalidRequestError("priority", f"must be an integer >= 0, got {priority!r}")
        params.validate()
        num_token_ids = min(len(self.tokenizer), self.runner.model.cfg.vocab_size)
        check_logit_bias(params.logit_bias, num_token_ids)
        if not all(0 <= t < num_token_ids for t in params.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"token ids must be integers in [0, {num_token_ids})")
        stops = stop_token_set(params, self.eos_token_ids)
        check_allowed_tokens(params.allowed_token_ids, num_token_ids, params.min_tokens, stops)
        prompt_ids = self._tokenize(prompt)
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            field = "prompt" if len(prompt_ids) >= self.max_model_len else "max_tokens"
            raise PromptTooLongError(
                field,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens",
            )
        needed_blocks = self.block_manager.blocks_for(len(prompt_ids) + params.max_tokens)
        if needed_blocks > self.block_manager.num_blocks:
            raise PromptTooLongError("max_tokens", "the request needs more KV cache than the engine has in total")
        generator = None
        if not params.is_greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_rng))
            generator = torch.Generator().manual_seed(seed)
        seq = Sequence(
            request_id=request_id,
            token_ids=list(prompt_ids),
            num_prompt_tokens=len(prompt_ids),
            params=params,
            detokenizer=Detokenizer(self._decode if params.skip_special_tokens else self._decode_special, prompt_ids,
                                    params.stop, params.include_stop_str_in_output),  # fmt: skip
            generator=generator,
            spec=self.speculator.new_state(params, prompt_ids),
            priority=priority,
            grammar=self._grammar_matcher(params, prompt_ids),
        )
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return len(prompt_ids)

    def _grammar_matcher(self, params: SamplingParams, prompt_ids: list[int]) -> GrammarMatcher | None:
        """The request's grammar state, past the output it resumes after (params.num_resumed_tokens)."""
        if params.grammar is None:
            return None
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.runner.model.cfg.vocab_size, self.eos_token_ids)
        matcher = self._grammar_compiler.matcher(params.grammar)
        resumed = prompt_ids[len(prompt_ids) - params.num_resumed_tokens :] if params.num_resumed_tokens else []
        if matcher.valid_prefix(resumed) != len(resumed):
            raise InvalidRequestError("response_format", "the output it resumes after does not follow its grammar")
        for token in resumed:
            matcher.advance(token)
        return matcher

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            return self._encode(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError("prompt", "must be a non-empty string or list of token ids")
        vocab = len(self.tokenizer)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise InvalidRequestError("prompt", f"token ids must be integers in [0, {vocab})")
        return list(prompt)

    def abort(self, request_id: str) -> bool:
        """Drop a request now and free its KV; False if it is unknown or already finished."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished()

    def free_capacity(self) -> int:
        """How many more requests could start now (0 while any request still waits)."""
        if self.scheduler.waiting:
            return 0
        return max(0, self.cfg.max_num_seqs - len(self.scheduler.running))

    def room_after_waiting(self) -> int:
        """How many more requests could start at the next step once the ones waiting now start there: none while
        the last step's plan left one waiting (slots or KV ran short), else the free slots less the waiting ones.
        The worker's puller (workers/worker/puller.py) pulls up to this while that step runs."""
        if self._num_left_waiting:
            return 0
        return max(0, self.cfg.max_num_seqs - len(self.scheduler.running) - len(self.scheduler.waiting))

    def free_capacity_for(self, priority: int) -> int:
        """How many more requests of `priority` could start now: free slots, or else the running requests
        less urgent than it that may still be preempted for it (none while one as urgent waits)."""
        return self.free_capacity() or self.scheduler.num_preemptible_for(priority)

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        step_start_s = time.perf_counter()
        self.speculator.begin_step()
        plan = self.last_plan = self.scheduler.schedule()
        self._num_left_waiting = len(self.scheduler.waiting)  # room_after_waiting()
        if plan.is_empty:
            return []
        proposed = self.speculator.propose(plan.speculating)
        self.applier.apply_proposals(proposed, self.sequences)
        proposals = proposed.to_verify  # request_id -> draft tokens scored this step
        start_s = time.perf_counter()
        items = [forward_item(s, proposals.get(s.request_id)) for s in plan.scheduled]
        num_verify = [it.num_logits for it in items]  # the rows verification reads: the last ones of each item
        items = [widen(s, it) for s, it in zip(plan.scheduled, items, strict=True)]  # echo: every prompt row
        # EAGLE sequences keep their committed tokens' features from this same pass
        with_features = any(s.seq.spec is not None and s.seq.spec.wants_features for s in plan.scheduled)
        # [S, V], [T, hidden] | None, on the model's device
        logits, features = self.runner.forward_with_features(items, with_features)
        rows = verify_rows(items, num_verify)
        sampling = [s for s in plan.scheduled if s.is_sampling]  # 1 + proposal size logits rows each, in order
        entries = [VerifyEntry(s.seq.params, s.seq.generator, proposals.get(s.request_id)) for s in sampling]
        if logits.device.type != "cpu" and not _reads_argmax_only(plan, entries):
            logits = to_host(logits)  # sampling, grammars and logprobs read logits on the host (models/device.py)
        if rows is not None:
            rows = rows.to(logits.device)
        verify_logits = logits if rows is None else logits.index_select(0, rows)  # [sum(1 + drafts), V]
        drafts = [e.proposal.tokens if e.proposal else [] for e in entries]  # [B] each one's draft tokens, in order
        # each request's rules (logit_bias, penalties, min_tokens, grammar) on the rows verification reads
        verify_logits = processed_logits(logits, verify_logits, sampling, drafts, self.eos_token_ids)
        verdicts = self.speculator.verify(entries, verify_logits)
        if proposals:
            self.speculator.stats.verify_time_s += time.perf_counter() - start_s
        verified = {s.request_id: (e.proposal, v) for s, e, v in zip(sampling, entries, verdicts, strict=True)}
        outputs = self._postprocess(plan, verified, items, features, StepLogits(logits, items))
        # the draft model and the head take in what this pass's prefill chunks computed, and the prompts they
        # did not take in while speculation was off at this batch (Speculator.prefill)
        prefilled = [
            s.seq for s in plan.scheduled
            if s.request_id in self.sequences and (s.num_new_tokens > 1 or self.speculator.lacks_intake(s.seq))
        ]  # fmt: skip
        if prefilled:
            self.applier.apply_proposals(self.speculator.prefill(prefilled), self.sequences)
            for seq in prefilled:
                if seq.request_id in self.sequences:
                    self.block_manager.register(seq)  # the proposer rows its intake computed
        num_tokens = sum(len(out.new_token_ids) for out in outputs)
        self.speculator.end_step(time.perf_counter() - step_start_s, len(plan.scheduled), len(proposals), num_tokens)
        return outputs

    def _postprocess(
        self,
        plan: SchedulerOutput,
        verified: dict[str, tuple[Proposal | None, Verdict]],
        items: list[ForwardItem],  # [num_scheduled] what the target pass computed, in plan order
        features: torch.Tensor | None,  # [T, hidden] the pass's own features, items' rows back to back; None = unused
        step_logits: StepLogits,  # the pass's logits by item: the logprobs requests ask for come from them
    ) -> list[StepOutput]:
        outputs = []
        now = time.perf_counter()
        row = 0
        for index, (s, item) in enumerate(zip(plan.scheduled, items, strict=True)):
            first_row = row  # the item's rows of `features`: first_row .. row - 1
            row += len(item.token_ids)
            step_logits.record_prompt(index, s)  # echo: the prompt tokens this chunk scored
            if s.request_id not in verified:
                self.applier.apply_chunk(s, features, first_row, row - first_row)  # a chunk short of the prompt's end
                self.block_manager.register(s.seq)
                continue
            proposal, verdict = verified[s.request_id]
            appended, reason = self.applier.apply_verdict(s, proposal, verdict, now, features, first_row)
            self.block_manager.register(s.seq)  # before a finish frees them: a next turn finds its blocks
            num_top = s.seq.params.logprobs
            logprobs = None if num_top is None else step_logits.of_tokens(index, proposal, verdict, appended, num_top)
            seq = s.seq
            if reason is not None:
                self.scheduler.finish(seq, reason)
                del self.sequences[seq.request_id]
            else:
                self.block_manager.truncate(seq, len(seq))  # unused lookahead blocks go back
            outputs.append(self._output(seq, appended, now, logprobs))
        return outputs

    def _output(
        self, seq: Sequence, tokens: list[int], now: float, logprobs: list[TokenLogprob] | None = None
    ) -> StepOutput:
        metrics: dict[str, float] = {}
        if seq.is_finished:
            first_token = seq.first_token_time_s or now
            decode_s = now - first_token
            metrics = {
                "ttft_ms": (first_token - seq.arrival_time_s) * 1e3,
                "tokens_per_s": (seq.num_output_tokens - 1) / decode_s if decode_s > 0 else 0.0,
                "num_preemptions": float(seq.num_preemptions),
            }
            if seq.spec is not None:
                metrics.update(seq.spec.metrics())
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            new_text=seq.detokenizer.take_new_text(seq.is_finished),
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            metrics=metrics,
            new_logprobs=logprobs,
            prompt_logprobs=self._prompt_logprobs_once(seq),
            num_cached_tokens=seq.num_cached_tokens,
        )

    @staticmethod
    def _prompt_logprobs_once(seq: Sequence) -> list[TokenLogprob] | None:
        """[num_prompt_tokens] the prompt's logprobs (its first token has none), on the first output only."""
        if seq.params.prompt_logprobs is None or seq.is_prompt_logprobs_sent:
            return None
        seq.is_prompt_logprobs_sent = True
        return [TokenLogprob(seq.token_ids[0], None), *seq.prompt_logprobs]


def _reads_argmax_only(plan: SchedulerOutput, entries: list[VerifyEntry]) -> bool:
    """Whether the step reads nothing of its logits but each verified row's argmax: greedy chains only, no
    grammar masking them, no logprobs asked for. A CUDA step's logits then stay on the device: its argmax
    comes back as S integers instead of S x V floats, and the host does not scan the vocabulary."""
    return reads_argmax_only(entries) and reads_only_raw_logits(plan.scheduled)


def forward_item(s: ScheduledSeq, proposal: Proposal | None) -> ForwardItem:
    """The runner's input for one plan entry: its chunk, then its draft tokens (a chain, or a tree's nodes)."""
    start = s.start_pos
    tokens = s.seq.token_ids[start : start + s.num_new_tokens]
    if proposal is None:
        return ForwardItem(tokens, start, s.block_table, num_logits=1 if s.is_sampling else 0)
    num_rows = 1 + proposal.num_tokens
    if proposal.tree is None:  # [last token, d_1 .. d_k], causal
        return ForwardItem(tokens + proposal.tokens, start, s.block_table, num_logits=num_rows)
    tree, length = proposal.tree, len(s.seq)
    tree_mask = torch.cat([torch.zeros(1, tree.num_nodes, dtype=torch.bool), tree.attention_mask()])  # [n + 1, n]
    return ForwardItem(
        tokens + proposal.tokens,
        start,
        s.block_table,
        num_logits=num_rows,
        positions=[start, *tree.positions(length).tolist()],
        tree_start=length,
        tree_mask=tree_mask,
    )
