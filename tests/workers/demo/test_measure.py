import torch
from transformers import AutoModelForCausalLM

from workers.demo.build import DemoPair
from workers.demo.measure import engine_forward_costs, forward_costs, greedy_agreement


def test_a_model_agrees_with_itself_everywhere(micro_pair: DemoPair) -> None:
    target = AutoModelForCausalLM.from_pretrained(micro_pair.target_dir).eval()
    prompts_ids = [[5, 6, 7, 8], [9, 10]]

    agreement = greedy_agreement(target, target, prompts_ids, max_new_tokens=6)

    assert 2 <= agreement.num_positions <= 12  # stops early only at EOS
    assert agreement.rate == 1.0
    assert 0 < agreement.distinct_bigram_rate <= 1


def test_agreement_counts_positions_where_the_argmaxes_differ(micro_pair: DemoPair) -> None:
    target = AutoModelForCausalLM.from_pretrained(micro_pair.target_dir).eval()
    draft = AutoModelForCausalLM.from_pretrained(micro_pair.draft_dir).eval()
    with torch.no_grad():
        draft.lm_head.weight.neg_()  # tied: the draft now ranks tokens in reverse of what it learned

    agreement = greedy_agreement(target, draft, [[5, 6, 7, 8]], max_new_tokens=8)

    assert agreement.num_positions >= 1
    assert 0 <= agreement.num_agreed < agreement.num_positions


def test_forward_costs_time_every_model(micro_pair: DemoPair) -> None:
    target = AutoModelForCausalLM.from_pretrained(micro_pair.target_dir).eval()
    draft = AutoModelForCausalLM.from_pretrained(micro_pair.draft_dir).eval()

    costs = forward_costs(
        {"target": target, "draft": draft}, num_new_tokens=4, num_cached_tokens=16, num_repeats=5
    )

    assert set(costs) == {"target", "draft"}
    for cost in costs.values():
        assert 0 < cost.min_ms <= cost.median_ms


def test_engine_forward_costs_time_every_model(micro_pair: DemoPair) -> None:
    costs = engine_forward_costs(
        {"target": micro_pair.target_dir, "draft": micro_pair.draft_dir},
        num_new_tokens=4,
        num_cached_tokens=16,
        num_repeats=5,
    )

    assert set(costs) == {"target", "draft"}
    for cost in costs.values():
        assert 0 < cost.min_ms <= cost.median_ms
