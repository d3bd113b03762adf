"""Warm-up on a real engine (tiny pair, speculating with the draft) and a real worker loop: it runs every pass
shape up to a step's tokens, prefill (chunked), greedy, sampled and plain decoding and every batch bucket,
leaves the engine empty, and the worker heartbeats (so /readyz turns ready) only after it and once its writer
process is connected."""

from pathlib import Path

import redis

from shared import keys
from shared.settings import ServiceSettings
from tests.helpers.engine_worker import EngineThread
from tests.helpers.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.worker.warmup import warm_up


def test_warm_up_covers_prefill_speculation_and_batch_buckets(tiny_pair: tuple[Path, Path]) -> None:
    target, draft = tiny_pair
    cfg = EngineConfig(target_dir=str(target), kv_cache_mb=16, max_num_seqs=16, num_threads=1,
                       max_num_batched_tokens=64)
    engine = Engine(cfg, target, draft)
    report = warm_up(engine)
    assert report.batch_sizes == [1, 1, 1, 1, 2, 16]  # prefill, greedy, sampled, plain; batch buckets 2 and 16
    # every runner ran each token count of a step first, with as many logits rows: min(64, 16 x (1 + 8))
    for runner in (engine.runner, engine.speculator.draft.runner):
        assert set(range(1, 65)) <= runner.shapes_run.tokens and set(range(1, 65)) <= runner.shapes_run.logits_rows
    assert 0 < report.shapes_s < report.duration_s
    assert engine.num_unfinished() == 0 and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.speculator.stats.counts.num_steps > 0  # the draft proposed and the target verified
    assert engine.free_capacity() == cfg.max_num_seqs


def test_worker_is_ready_only_after_warm_up(
    settings: ServiceSettings, rclient: redis.Redis, tiny_target: Path
) -> None:
    settings.warm_up = True
    worker = EngineThread(settings, tiny_target, worker_id="warm", model_name="tiny", max_num_seqs=4)
    assert worker.worker.warmup is None
    worker.start()
    try:
        wait_until(lambda: rclient.zscore(keys.WORKERS_ZSET, "warm") is not None, what="the first heartbeat")
        report = worker.worker.warmup  # set in the worker's thread before its first heartbeat
        assert report is not None and report.num_requests > 0 and report.batch_sizes[-1] == 4
    finally:
        worker.stop()


def test_worker_is_ready_only_once_its_writer_is_connected(
    settings: ServiceSettings, rclient: redis.Redis, tiny_target: Path
) -> None:
    """A worker marked alive takes a job at once: its writer process started and paced before the first beat."""
    worker = EngineThread(settings, tiny_target, worker_id="writer-first", model_name="tiny", max_num_seqs=4)
    heartbeat = worker.worker.heartbeat
    real_beat = heartbeat.beat
    writer_ready_at_beats: list[bool] = []

    def beat() -> None:
        writer_ready_at_beats.append(worker.worker.writer.pacing is not None)
        real_beat()

    heartbeat.beat = beat  # type: ignore[method-assign]
    worker.start()
    try:
        wait_until(lambda: rclient.zscore(keys.WORKERS_ZSET, "writer-first") is not None, what="the first heartbeat")
        assert writer_ready_at_beats[0]
    finally:
        worker.stop()


def test_pass_shapes_are_warmed_only_while_no_sequence_holds_kv(tiny_pair: tuple[Path, Path]) -> None:
    """Engine.warm_pass_shapes runs each runner at 1..warm_pass_tokens tokens, writing K/V into blocks 0..: so it
    is refused once a request runs."""
    import pytest

    from workers.engine.sampling_params import SamplingParams

    target, draft = tiny_pair
    cfg = EngineConfig(target_dir=str(target), kv_cache_mb=16, num_threads=1, warm_pass_tokens=37)
    engine = Engine(cfg, target, draft)
    assert engine.warm_pass_shapes() > 0
    for runner in (engine.runner, engine.speculator.draft.runner):
        assert set(range(1, 38)) <= runner.shapes_run.tokens and set(range(1, 38)) <= runner.shapes_run.logits_rows
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(RuntimeError, match="before requests"):
        engine.warm_pass_shapes()
