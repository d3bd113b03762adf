"""Decode graphs' static passes (workers/engine/decode_graphs.py), run op by op on the CPU: the buckets, the
padding rows, and the tokens an engine decodes through them against the same engine decoding dynamically.
A CUDA device replays these same passes from captured graphs (tests/workers/engine/test_cuda.py)."""

import dataclasses
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from shared.speculation import SpeculativeMethod
from tests.workers.engine_runs import greedy, make_engine, run_all, spec_engine, tokens
from workers.engine.decode_graphs import (
    DecodeGraphs,
    GraphBucket,
    GraphShape,
    batch_buckets,
    block_buckets,
    graphs_for,
    query_buckets,
)
from workers.engine.head_runner import HeadRunner
from workers.engine.model_runner import ForwardItem, ModelRunner
from workers.models.eagle_head import load_head
from workers.models.loader import load_model
from workers.worker.engine_metrics import EngineMetrics


def test_bucket_ladders() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert block_buckets(3) == [3]
    assert block_buckets(8) == [8]
    assert block_buckets(100) == [8, 16, 32, 64, 100]
    assert query_buckets(1) == [1]
    assert query_buckets(2) == [1, 2]
    assert query_buckets(4) == [1, 2, 3, 4]
    assert query_buckets(9) == [1, 2, 3, 5, 9]  # 1 + k for k = 0, 1, 2, 4, 8 drafts
    assert query_buckets(12) == [1, 2, 3, 5, 9, 12]


def _graphs(runner: ModelRunner, scratch_block: int, max_batch: int = 8, max_blocks: int = 20) -> DecodeGraphs:
    return graphs_for(runner, GraphShape(runner.block_size, scratch_block, max_batch, max_blocks), capture=False)


def test_a_pass_takes_the_smallest_bucket_that_holds_it(tiny_target: Path) -> None:
    runner = ModelRunner(load_model(tiny_target, torch.float32), num_blocks=21, block_size=4)
    graphs = _graphs(runner, scratch_block=20)

    assert graphs.bucket_for(3, 1) == GraphBucket(4, 8)
    assert graphs.bucket_for(8, 9) == GraphBucket(8, 16)
    assert graphs.bucket_for(1, 20) == GraphBucket(1, 20)
    assert graphs.bucket_for(9, 1) is None  # more rows than the largest bucket: op by op
    assert graphs.bucket_for(1, 21) is None
    assert graphs.run([ForwardItem([1, 2], 0, [0], num_logits=1)], with_features=False) is None  # not a decode
    assert graphs.num_passes == 0


def test_verify_buckets_hold_a_few_queries_a_row_within_the_token_budget(tiny_target: Path) -> None:
    runner = ModelRunner(load_model(tiny_target, torch.float32), num_blocks=21, block_size=4)
    shape = GraphShape(4, 20, max_batch=8, max_blocks=20, max_queries=9, max_tokens=32)
    graphs = graphs_for(runner, shape, capture=False)

    assert graphs.query_sizes == [1, 2, 3, 5, 9]
    assert graphs.bucket_for(3, 1, 4) == GraphBucket(4, 8, 5)
    assert graphs.bucket_for(1, 9, 9) == GraphBucket(1, 16, 9)
    assert graphs.bucket_for(8, 1, 5) is None  # 8 rows x 5 queries: over the 32-token budget
    assert graphs.bucket_for(1, 1, 10) is None  # more queries than the longest row
    assert all(b.num_tokens <= 32 for b in graphs.buckets) and GraphBucket(8, 8, 5) not in graphs.buckets
    assert graphs.columns.shape == (7, 24) and graphs.tables.shape == (8, 20)  # 8 rows x 3: the most tokens
    wide = torch.ones(2, 64, dtype=torch.bool)  # a tree of 64 slots: its rows' visible slots exceed a bitmask
    assert graphs.run([ForwardItem([1, 2], 3, [0], 2, [3, 4], 3, wide)], with_features=False) is None
    assert graphs.run([ForwardItem(list(range(10)), 0, [0, 1, 2], num_logits=1)], with_features=False) is None


def _prefilled(model_dir: Path, sliding_window: int | None) -> tuple[ModelRunner, ModelRunner]:
    """Two runners over the same float64 model (the sliding window set), each with three prompts' K/V."""
    model = load_model(model_dir, torch.float64)
    model.cfg = dataclasses.replace(model.cfg, sliding_window=sliding_window)
    dynamic, static = ModelRunner(model, 21, 4), ModelRunner(model, 21, 4)
    prompts = {0: ([5, 6, 7, 8, 9], [0, 1, 7]), 1: ([11, 12], [2]), 2: (list(range(20, 33)), [3, 4, 5, 6])}
    for runner in (dynamic, static):
        runner.forward([ForwardItem(ids, 0, table, num_logits=1) for ids, table in prompts.values()])
    return dynamic, static


@pytest.mark.parametrize("sliding_window", [None, 6])
@torch.inference_mode()
def test_a_verify_pass_through_its_static_pass_matches_the_dynamic_pass(
    tiny_target: Path, sliding_window: int | None
) -> None:
    """Sequences of 4, 2 and 1 query tokens (a chain verify's last token + drafts, with all, the last, or no
    logits) in a bucket of 4 rows x 5 queries: the dynamic pass's logits, features and K/V; the padding tokens
    (past each sequence's own, and the fourth row) touch no block but the scratch block."""
    dynamic, static = _prefilled(tiny_target, sliding_window)
    shape = GraphShape(4, 20, max_batch=8, max_blocks=20, max_queries=5)
    static.graphs = graphs_for(static, shape, capture=False)
    before = [k.clone() for k, _ in static.kv_caches]
    items = [
        ForwardItem([41, 42, 43, 44], 5, [0, 1, 7], num_logits=4),  # crosses into its third block
        ForwardItem([45, 46], 2, [2], num_logits=1),
        ForwardItem([47], 13, [3, 4, 5, 6], num_logits=0),
    ]

    want, want_h = dynamic.forward_with_features(items, with_features=True)
    got, got_h = static.forward_with_features(items, with_features=True)

    assert static.graphs.num_passes_by_queries == {5: 1}
    assert got.shape == want.shape == (5, dynamic.model.cfg.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert got_h is not None and want_h is not None and got_h.shape == (7, dynamic.model.cfg.hidden_size)
    torch.testing.assert_close(got_h, want_h, rtol=1e-9, atol=1e-9)
    for (k_dynamic, _), (k_static, _), k_before in zip(dynamic.kv_caches, static.kv_caches, before, strict=True):
        torch.testing.assert_close(k_static[:20], k_dynamic[:20], rtol=1e-9, atol=1e-9)
        changed = (k_static != k_before).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) == {1, 7, 2, 6, 20}  # the sequences' new slots, and the padding's scratch block


@pytest.mark.parametrize("sliding_window", [None, 6])
@torch.inference_mode()
def test_padding_rows_write_the_scratch_block_alone_and_logits_match(
    tiny_target: Path, sliding_window: int | None
) -> None:
    """Three sequences in a bucket of 4 rows: the same logits and K/V as the dynamic pass, and the fourth
    (padding) row touches no block but the scratch block; with a sliding window too."""
    model = load_model(tiny_target, torch.float64)
    model.cfg = dataclasses.replace(model.cfg, sliding_window=sliding_window)
    dynamic, static = ModelRunner(model, 21, 4), ModelRunner(model, 21, 4)
    prompts = {0: ([5, 6, 7, 8, 9], [0, 1]), 1: ([11, 12], [2]), 2: (list(range(20, 33)), [3, 4, 5, 6])}
    for runner in (dynamic, static):
        runner.forward([ForwardItem(ids, 0, table, num_logits=1) for ids, table in prompts.values()])
    static.graphs = _graphs(static, scratch_block=20)
    before = [k.clone() for k, _ in static.kv_caches]
    items = [
        ForwardItem([41], 5, [0, 1], num_logits=1),
        ForwardItem([42], 2, [2], num_logits=0),  # no logits wanted from this one
        ForwardItem([43], 13, [3, 4, 5, 6], num_logits=1),
    ]

    want, want_h = dynamic.forward_with_features(items, with_features=True)
    got, got_h = static.forward_with_features(items, with_features=True)

    assert static.graphs.num_passes == 1
    assert got.shape == want.shape == (2, model.cfg.vocab_size)
    outputs = (static.graphs.logits_out, static.graphs.h_out)  # one pair for every bucket: B_max = 8 rows
    assert outputs[0] is not None and outputs[0].shape == (8, model.cfg.vocab_size)
    assert outputs[1] is not None and outputs[1].shape == (8, model.cfg.hidden_size)
    outputs[0].zero_(), outputs[1].zero_()  # the next pass rewrites them: what a pass returned is a copy
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert got_h is not None and want_h is not None
    torch.testing.assert_close(got_h, want_h, rtol=1e-9, atol=1e-9)
    for (k_dynamic, _), (k_static, _), k_before in zip(dynamic.kv_caches, static.kv_caches, before, strict=True):
        # every real block as the dynamic pass left it (to rounding: the passes' matmuls have other row counts)
        torch.testing.assert_close(k_static[:20], k_dynamic[:20], rtol=1e-9, atol=1e-9)
        changed = (k_static != k_before).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert 20 in changed  # the padding row wrote its K/V into the scratch block
        assert set(changed) <= {1, 2, 6, 20}  # beside it, only the three sequences' new slots


def test_greedy_tokens_through_static_passes_equal_dynamic(tiny_models: dict[str, Path]) -> None:
    """An engine decoding every plain decode pass through the static passes produces the dynamic engine's
    tokens: sequences of many lengths, batches that fill buckets partly, contexts across block widths."""
    gen = torch.Generator().manual_seed(3)
    requests = {
        f"r{i}": (torch.randint(1, 400, (3 + 7 * i,), generator=gen).tolist(), greedy(12 + 5 * i)) for i in range(6)
    }
    for layout in ("llama", "mistral"):
        dynamic = run_all(make_engine(tiny_models[layout], dtype="float64"), requests)
        engine = make_engine(tiny_models[layout], dtype="float64")
        assert engine.use_decode_graphs(capture=False) == {"target": 0.0}
        static = run_all(engine, requests)

        assert engine.runner.graphs is not None and engine.runner.graphs.num_passes > 0
        for rid in requests:
            assert tokens(static[rid]) == tokens(dynamic[rid]), (layout, rid)


@pytest.mark.parametrize("tree_size", [0, 5])
@pytest.mark.parametrize("method", [SpeculativeMethod.DRAFT, SpeculativeMethod.EAGLE])
def test_speculation_through_static_passes_keeps_the_target_output(
    eagle_models: dict[str, Path], method: SpeculativeMethod, tree_size: int
) -> None:
    """The draft model's (or head's) passes and the target's verify passes, chains or token trees, go through
    their static passes; the output is plain decoding's."""
    eagle = "copy_head" if method is SpeculativeMethod.EAGLE else None
    gen = torch.Generator().manual_seed(5)
    requests = {f"r{i}": (torch.randint(1, 400, (4 + 9 * i,), generator=gen).tolist(), greedy(30)) for i in range(4)}
    plain = run_all(make_engine(eagle_models["target"], dtype="float64"), requests)
    engine = spec_engine(eagle_models, eagle=eagle, speculative_method=method, tree_size=tree_size)
    engine.use_decode_graphs(capture=False)
    speculative = run_all(engine, requests)

    draft_graphs = engine.speculator.draft.runner.graphs if engine.speculator.draft is not None else None
    eagle_graphs = engine.speculator.eagle.runner.graphs if engine.speculator.eagle is not None else None
    assert draft_graphs is not None
    if method is SpeculativeMethod.DRAFT:
        assert draft_graphs.num_passes > 0
    else:  # the head's chain passes after the first (which catches up on several rows) are static
        assert eagle_graphs is not None and eagle_graphs.num_passes > 0
    assert engine.speculator.stats.counts.num_accepted > 0
    target_graphs = engine.runner.graphs
    assert target_graphs is not None and target_graphs.query_sizes == [1, 2, 3, 5, 9]  # k = 8: rows of 1 + 8
    assert sum(n for q, n in target_graphs.num_passes_by_queries.items() if q > 1) > 0  # verify passes served
    if tree_size:  # every verify pass a tree of up to 5 nodes after the last token: rows of 9 at most
        assert engine.speculator.stats.counts.num_accepted > 0
    for rid in requests:
        assert tokens(speculative[rid]) == tokens(plain[rid]), rid


@pytest.mark.parametrize("sliding_window", [None, 6])
@torch.inference_mode()
def test_token_trees_through_their_static_pass_match_the_dynamic_pass(
    tiny_target: Path, sliding_window: int | None
) -> None:
    """A tree verify (the last token, then 3 nodes whose mask rows name their ancestors), a chain, and a
    tree level (2 frontier nodes of a tree started earlier) in one pass of 4 rows x 5 queries: the dynamic
    pass's logits, features and K/V."""
    dynamic, static = _prefilled(tiny_target, sliding_window)
    static.graphs = graphs_for(static, GraphShape(4, 20, max_batch=8, max_blocks=20, max_queries=5), capture=False)
    nodes = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)  # parents: root, node 0, root
    verify_mask = torch.cat([torch.zeros(1, 3, dtype=torch.bool), nodes])  # [4, 3]: the last token sees no node
    level_mask = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # nodes 1 and 2 of a tree at slot 13
    items = [
        ForwardItem([41, 42, 43, 44], 5, [0, 1, 7], 4, positions=[5, 6, 7, 6], tree_start=6, tree_mask=verify_mask),
        ForwardItem([45, 46], 2, [2], num_logits=1),
        ForwardItem([47, 48], 14, [3, 4, 5, 6], 2, positions=[14, 14], tree_start=13, tree_mask=level_mask),
    ]

    want, want_h = dynamic.forward_with_features(items, with_features=True)
    got, got_h = static.forward_with_features(items, with_features=True)

    assert static.graphs.num_passes_by_queries == {5: 1}
    assert got.shape == want.shape == (7, dynamic.model.cfg.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert got_h is not None and want_h is not None
    torch.testing.assert_close(got_h, want_h, rtol=1e-9, atol=1e-9)
    for (k_dynamic, v_dynamic), (k_static, v_static) in zip(dynamic.kv_caches, static.kv_caches, strict=True):
        torch.testing.assert_close(k_static[:20], k_dynamic[:20], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(v_static[:20], v_dynamic[:20], rtol=1e-9, atol=1e-9)


def test_contexts_past_the_graph_limit_decode_op_by_op(tiny_models: dict[str, Path]) -> None:
    """cuda_graph_max_context caps the widest graph: sequences past it decode dynamically, same tokens."""
    requests = {"short": ([5, 6, 7], greedy(6)), "long": (list(range(10, 40)), greedy(10))}
    dynamic = run_all(make_engine(tiny_models["llama"], dtype="float64"), requests)
    engine = make_engine(tiny_models["llama"], dtype="float64", cuda_graph_max_context=16)  # 4 blocks of 4
    engine.use_decode_graphs(capture=False)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.block_widths == [4]

    static = run_all(engine, {"long": requests["long"]})  # 30 prompt tokens: past 16 from its first decode
    assert graphs.num_passes == 0
    static |= run_all(engine, {"short": requests["short"]})
    assert graphs.num_passes == 5  # the short one's decodes (its first token comes from the prefill)
    assert {rid: tokens(out) for rid, out in static.items()} == {rid: tokens(out) for rid, out in dynamic.items()}


@pytest.mark.parametrize("head_name", ["copy_head", "vocab_head"])
@torch.inference_mode()
def test_a_heads_static_pass_reads_its_features_like_the_dynamic_pass(
    eagle_models: dict[str, Path], head_name: str
) -> None:
    """An EAGLE head's chain pass (one token and one feature per sequence) through its static pass: the
    dynamic pass's logits (a draft vocabulary's -inf included) and h, three sequences in a bucket of 4."""
    target = load_model(eagle_models["target"], torch.float64)
    head = load_head(eagle_models[head_name], target)
    dynamic, static = HeadRunner(head, 21, 4), HeadRunner(head, 21, 4)
    gen = torch.Generator().manual_seed(2)
    hidden = head.cfg.hidden_size
    prompts = {0: ([5, 6, 7, 8, 9], [0, 1]), 1: ([11, 12], [2]), 2: (list(range(20, 33)), [3, 4, 5, 6])}
    prefill = [ForwardItem(ids, 0, table, num_logits=1) for ids, table in prompts.values()]
    prefill_features = torch.randn(20, hidden, generator=gen, dtype=torch.float64)
    for runner in (dynamic, static):
        runner.forward(prefill, prefill_features)
    static.graphs = graphs_for(static, GraphShape(4, 20, 8, 20), capture=False)
    items = [ForwardItem([41], 5, [0, 1], num_logits=1), ForwardItem([42], 2, [2], num_logits=1),
             ForwardItem([43], 13, [3, 4, 5, 6], num_logits=1)]
    features = torch.randn(3, hidden, generator=gen, dtype=torch.float64)

    want_logits, want_h = dynamic.forward(items, features)
    got_logits, got_h = static.forward(items, features)

    assert static.graphs.num_passes == 1
    assert torch.equal(torch.isinf(got_logits), torch.isinf(want_logits))
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_h, want_h, rtol=1e-9, atol=1e-9)

    # a catch-up pass (the tokens a verify accepted, their features, logits of each sequence's last ones)
    static.graphs = graphs_for(static, GraphShape(4, 20, 8, 20, max_queries=3), capture=False)
    items = [ForwardItem([51, 52], 6, [0, 1], num_logits=2), ForwardItem([54], 3, [2], num_logits=1),
             ForwardItem([55, 56], 14, [3, 4, 5, 6], num_logits=1)]
    features = torch.randn(5, hidden, generator=gen, dtype=torch.float64)

    want_logits, want_h = dynamic.forward(items, features)
    got_logits, got_h = static.forward(items, features)

    assert static.graphs.num_passes_by_queries == {2: 1}  # 4 rows of 2 (the second row's second token a pad)
    assert got_logits.shape == (4, head.cfg.vocab_size) and got_h.shape == (4, hidden)
    assert torch.equal(torch.isinf(got_logits), torch.isinf(want_logits))
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_h, want_h, rtol=1e-9, atol=1e-9)


def test_the_models_served_by_graphs_are_exported(tiny_pair: tuple[Path, Path]) -> None:
    # on the CPU by name: on a GPU machine the default device is CUDA, where the engine captures at start-up
    plain = make_engine(tiny_pair[0], tiny_pair[1], speculative_method="draft", device="cpu")
    registry = CollectorRegistry()
    EngineMetrics(registry).update(plain, [])
    assert registry.get_sample_value("specfleet_engine_cuda_graph_capture_seconds", {"model": "target"}) is None

    graphed = make_engine(tiny_pair[0], tiny_pair[1], speculative_method="draft", device="cpu")
    assert graphed.use_decode_graphs(capture=False) == {"target": 0.0, "draft": 0.0}  # nothing captured on the CPU
    registry = CollectorRegistry()
    EngineMetrics(registry).update(graphed, [])
    for model in ("target", "draft"):
        assert registry.get_sample_value("specfleet_engine_cuda_graph_capture_seconds", {"model": model}) == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a capture that fails: here, no CUDA device")
def test_a_failed_capture_leaves_the_model_decoding_op_by_op(
    tiny_pair: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(tiny_pair[0], tiny_pair[1], speculative_method="draft")
    requests = {"a": ([5, 6, 7], greedy(8))}
    before = run_all(engine, requests)

    assert engine.use_decode_graphs(capture=True) == {}  # capturing needs CUDA: it raises, is logged, is skipped
    assert engine.runner.graphs is None and engine.speculator.draft is not None
    assert engine.speculator.draft.runner.graphs is None
    assert "capturing the target model's decode graphs failed" in caplog.text
    assert tokens(run_all(engine, requests)["a"]) == tokens(before["a"])
