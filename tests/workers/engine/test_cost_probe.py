"""The start-up attention probe recovers a pass's cost per committed key and per query row x key."""

import pytest

from workers.engine.cost_probe import ATTENTION_EXTRA_TOKENS, ATTENTION_ROWS, probe_attention
from workers.engine.model_runner import ForwardItem, attention_work
from workers.spec.pass_costs import AttentionCost


class ModelledHost:
    """A forward that takes what the cost model says (a dense part per token, plus attention), on a clock of
    its own: the probe's arithmetic is checked without timing anything."""

    def __init__(self, cost: AttentionCost, dense_s_per_token: float = 50e-6, first_run_s: float = 1.0) -> None:
        self.cost = cost
        self.dense_s_per_token = dense_s_per_token
        self.first_run_s = first_run_s  # a slow first pass of each shape (the probe warms up and keeps the best)
        self.now_s = 0.0
        self.passes: list[list[ForwardItem]] = []

    def clock(self) -> float:
        return self.now_s

    def forward(self, items: list[ForwardItem]) -> None:
        shape = (len(items[0].token_ids), items[0].start_pos)
        is_first = all((len(p[0].token_ids), p[0].start_pos) != shape for p in self.passes)
        self.passes.append(items)
        num_tokens = sum(len(item.token_ids) for item in items)
        self.now_s += 0.002 + self.dense_s_per_token * num_tokens + self.cost.seconds(attention_work(items))
        self.now_s += self.first_run_s if is_first else 0.0


def test_the_probe_recovers_both_rates_from_two_contexts_and_two_row_counts() -> None:
    host = ModelledHost(AttentionCost(s_per_key=0.3e-6, s_per_pair=0.2e-6))
    cost = probe_attention(host.forward, block_size=16, num_cache_blocks=1000, max_seqs=64, max_tokens=512,
                           clock=host.clock)  # fmt: skip
    assert cost.s_per_key == pytest.approx(0.3e-6) and cost.s_per_pair == pytest.approx(0.2e-6)
    probe_rows = {len(item.token_ids) for items in host.passes for item in items}
    assert probe_rows == {1, ATTENTION_ROWS}
    long_items = [items for items in host.passes if items[0].start_pos > 32][0]
    blocks = [block for item in long_items for block in item.block_table]
    assert len(blocks) == len(set(blocks))  # each sequence reads K/V of its own, as a batch of requests does


def test_the_probe_fits_the_cache_and_the_limits_or_measures_nothing() -> None:
    host = ModelledHost(AttentionCost(s_per_key=1e-6))
    blocks_per_seq = -(-(32 + ATTENTION_EXTRA_TOKENS + ATTENTION_ROWS) // 16)
    cost = probe_attention(host.forward, 16, 3 * blocks_per_seq, 64, 512, clock=host.clock)
    assert {len(items) for items in host.passes} == {3}  # as many sequences as the cache holds
    assert cost.s_per_key == pytest.approx(1e-6) and cost.s_per_pair == pytest.approx(0.0, abs=1e-15)
    host.passes.clear()
    assert probe_attention(host.forward, 16, blocks_per_seq - 1, 64, 512, clock=host.clock) == AttentionCost()
    assert host.passes == []  # no room for one sequence: zero rates, as before the probe existed


def test_a_host_where_context_costs_nothing_gets_zero_rates_never_negative_ones() -> None:
    host = ModelledHost(AttentionCost())
    cost = probe_attention(host.forward, 16, 1000, 16, 512, clock=host.clock)
    assert cost == AttentionCost()
