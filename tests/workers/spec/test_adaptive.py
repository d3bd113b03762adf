"""The per-sequence acceptance estimate and nominal k: follows acceptance, falls back."""

import pytest

from workers.spec.adaptive import AdaptiveConfig, PooledAcceptance, SpecLengthController, best_k

CONFIG = AdaptiveConfig(k_min=1, k_max=8, fallback_acceptance=0.2, fallback_patience_steps=5)


def test_k_rises_with_acceptance() -> None:
    controller = SpecLengthController(CONFIG)
    k_start = controller.k
    for _ in range(20):
        controller.update(num_drafted=controller.k, num_accepted=controller.k)
    assert controller.k == CONFIG.k_max > k_start
    assert controller.acceptance > 0.95  # the prior's 2 tokens at 0.6 against ~27 weighted accepted ones


def test_k_falls_without_acceptance() -> None:
    controller = SpecLengthController(AdaptiveConfig(fallback_acceptance=0.0))  # never falls back
    for _ in range(10):
        controller.update(num_drafted=controller.k, num_accepted=controller.k)
    ks = []
    for _ in range(10):
        controller.update(num_drafted=controller.k, num_accepted=0)
        ks.append(controller.k)
    assert ks == sorted(ks, reverse=True)
    assert ks[-1] == 1 and not controller.is_fallen_back


def test_acceptance_counts_only_judged_positions() -> None:
    controller = SpecLengthController(AdaptiveConfig(decay=0.0, prior_weight=1e-9))  # only the last step counts
    controller.update(num_drafted=8, num_accepted=3)  # 3 accepted, the 4th rejected, 4 never judged
    assert controller.acceptance == pytest.approx(3 / 4)


def test_one_early_rejection_leaves_the_estimate_near_the_prior() -> None:
    """The prior is worth prior_weight tested tokens in every estimate: one miss on a sequence's first draft
    takes alpha from 0.8 to 0.47, not to the 0.25 of a prior that one tested token outweighs."""
    pool = PooledAcceptance(initial_acceptance=0.8)
    controller = SpecLengthController(AdaptiveConfig(prior_weight=2.0), pool)
    assert controller.acceptance == pytest.approx(0.8)
    controller.update(num_drafted=8, num_accepted=0)
    assert controller.acceptance == pytest.approx((0 + 2 * pool.acceptance) / (1 + 2))
    assert controller.acceptance > 0.45  # and the pool (worth 8 tested tokens at the start) to 0.71


def test_sequences_start_from_and_feed_their_proposer_s_pooled_acceptance() -> None:
    pool = PooledAcceptance(initial_acceptance=0.6, decay=0.9)
    veteran = SpecLengthController(AdaptiveConfig(), pool)
    for _ in range(60):  # 7 of 8 accepted, the 8th rejected: 7 of 8 judged
        veteran.update(num_drafted=8, num_accepted=7)
    assert pool.acceptance == pytest.approx(7 / 8, abs=1e-3)
    newcomer = SpecLengthController(AdaptiveConfig(), pool)
    assert newcomer.acceptance == pytest.approx(7 / 8, abs=1e-3)  # not the constant 0.6
    seeded = SpecLengthController(AdaptiveConfig())  # no pool: a seeded request keeps the constant prior
    assert seeded.acceptance == pytest.approx(0.6)
    for _ in range(3):
        newcomer.update(num_drafted=4, num_accepted=0)
    for _ in range(500):  # idle steps drift back to the pool's figure
        newcomer.idle()
    assert newcomer.acceptance == pytest.approx(pool.acceptance, abs=1e-3)


def test_fallback_after_patience_steps_of_poor_acceptance() -> None:
    controller = SpecLengthController(CONFIG)
    events = [controller.update(num_drafted=max(controller.k, 1), num_accepted=0) for _ in range(12)]
    assert events.count(True) == 1  # counted once
    assert controller.is_fallen_back and controller.k == 0
    assert controller.update(num_drafted=4, num_accepted=4) is False  # stays off
    assert controller.k == 0


def test_a_good_step_resets_the_poor_streak() -> None:
    controller = SpecLengthController(
        AdaptiveConfig(decay=0.0, fallback_acceptance=0.5, fallback_patience_steps=3)
    )
    for _ in range(10):
        controller.update(num_drafted=4, num_accepted=0)
        controller.update(num_drafted=4, num_accepted=0)
        controller.update(num_drafted=4, num_accepted=4)
    assert not controller.is_fallen_back


def test_best_k_grows_with_acceptance_and_shrinks_with_draft_cost() -> None:
    ks = [best_k(a / 10, CONFIG) for a in range(11)]
    assert ks == sorted(ks) and ks[0] == CONFIG.k_min and ks[-1] == CONFIG.k_max
    cheap = AdaptiveConfig(draft_cost_per_token=0.02)
    dear = AdaptiveConfig(draft_cost_per_token=0.5)
    assert best_k(0.7, cheap) > best_k(0.7, dear)


@pytest.mark.parametrize(
    "fields",
    [
        {"k_min": 0},
        {"k_min": 5, "k_max": 4},
        {"initial_acceptance": 1.5},
        {"prior_weight": 0.0},
        {"decay": 1.0},
        {"draft_cost_per_token": 0.0},
        {"fallback_acceptance": 1.0},
        {"fallback_patience_steps": 0},
    ],
)
def test_config_rejects_bad_values(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AdaptiveConfig(**fields)  # type: ignore[arg-type]


def test_update_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError):
        SpecLengthController(CONFIG).update(num_drafted=2, num_accepted=3)



def test_steps_without_drafts_bring_the_estimate_back_toward_the_prior() -> None:
    """A sequence the policy stopped drafting for must be tried again some time: idle steps move alpha
    back toward initial_acceptance, a little each, and never past it."""
    controller = SpecLengthController(AdaptiveConfig(fallback_acceptance=0.0, idle_recovery=0.1))
    for _ in range(3):
        controller.update(num_drafted=4, num_accepted=0)
    low = controller.acceptance
    controller.idle()
    assert low < controller.acceptance < 0.6
    for _ in range(200):
        controller.idle()
    assert controller.acceptance == pytest.approx(0.6, abs=1e-3)


def test_trees_keep_their_own_level_estimate() -> None:
    controller = SpecLengthController(AdaptiveConfig(decay=0.0))
    assert controller.tree_level_acceptance is None  # no tree verified yet: the policy derives it from alpha
    controller.update_tree(depth=3, num_accepted=1)  # level 1 passed, level 2 failed, level 3 never judged
    assert controller.tree_level_acceptance == pytest.approx(1 / 2)
    alpha = controller.acceptance
    controller.update_tree(depth=3, num_accepted=3)
    assert controller.tree_level_acceptance == 1.0 and controller.acceptance == alpha  # chains' estimate untouched
