"""`bench e2e`: where the fleet worker's loop spent a latency round, from its /metrics
(`specfleet_worker_loop_seconds{part}` and `specfleet_worker_engine_steps`: workers/worker/loop_time.py).

A scrape before a round and one after give the round's seconds by part and its engine steps; the rows carry each
part's share of the loop's wall time (`loop_<part>_share`) and the tokens an engine step made
(`tokens_per_engine_step`: the in-process engine's rows count their steps too), so a fleet/engine gap splits
into the loop's parts outside the engine's step and the batch's fill; and the share of the round's jobs that the
worker's puller thread pulled while the engine stepped (`pulled_by_puller_share`: `specfleet_worker_pulled_jobs`,
the rest were the loop's own pulls, which it waits for).
"""

from dataclasses import dataclass, field

from workers.bench.http_client import metric_samples

LOOP_SECONDS = "specfleet_worker_loop_seconds"
ENGINE_STEPS = "specfleet_worker_engine_steps"
PULLED_JOBS = "specfleet_worker_pulled_jobs"


@dataclass
class LoopSnapshot:
    seconds: dict[str, float] = field(default_factory=dict)  # part -> seconds so far
    num_engine_steps: float = 0.0
    num_pulled: dict[str, float] = field(default_factory=dict)  # by (loop | puller) -> jobs pulled so far

    def since(self, before: "LoopSnapshot") -> "LoopSnapshot":
        return LoopSnapshot({part: s - before.seconds.get(part, 0.0) for part, s in self.seconds.items()},
                            self.num_engine_steps - before.num_engine_steps,
                            {by: n - before.num_pulled.get(by, 0.0) for by, n in self.num_pulled.items()})  # fmt: skip


def scrape(url: str) -> LoopSnapshot:
    """The worker's loop counters (an empty snapshot if it exports none)."""
    snapshot = LoopSnapshot()
    for sample in metric_samples(url):
        if sample.name == f"{LOOP_SECONDS}_total":
            snapshot.seconds[sample.labels["part"]] = sample.value
        elif sample.name == f"{ENGINE_STEPS}_total":
            snapshot.num_engine_steps = sample.value
        elif sample.name == f"{PULLED_JOBS}_total":
            snapshot.num_pulled[sample.labels["by"]] = sample.value
    return snapshot
