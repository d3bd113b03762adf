"""Measured / predicted step times by batch size, speculative against plain (step_calibration.py)."""

import pytest

from workers.spec.step_calibration import StepCalibration, bucket_of


def test_buckets_are_powers_of_two() -> None:
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 7, 8, 16, 31, 32)] == [1, 1, 2, 2, 3, 3, 4, 5, 5, 6]


def test_the_factor_is_how_much_more_speculative_steps_miss_than_plain_ones() -> None:
    calibration = StepCalibration(rate=1.0)
    assert calibration.speculative_factor(16) == 1.0  # nothing measured
    calibration.observe(16, True, predicted_s=0.040, measured_s=0.060)
    assert calibration.speculative_factor(16) == 1.0  # no plain step measured there yet
    calibration.observe(16, False, predicted_s=0.010, measured_s=0.012)
    assert calibration.speculative_factor(16) == pytest.approx(1.5 / 1.2)
    assert calibration.speculative_factor(17) == pytest.approx(1.5 / 1.2)  # the same bucket
    assert calibration.speculative_factor(1) == 1.0  # another batch size: its own figures


def test_averages_move_by_the_rate_and_clip_stalls() -> None:
    calibration = StepCalibration(rate=0.5)
    calibration.observe(1, False, 0.010, 0.010)
    calibration.observe(1, True, 0.010, 0.010)
    calibration.observe(1, True, 0.010, 0.030)
    assert calibration.speculative[1] == pytest.approx(2.0)
    calibration.observe(1, True, 0.010, 10.0)  # a stall of the host: clipped at 4x
    assert calibration.speculative[1] == pytest.approx(3.0)
    calibration.observe(1, True, 0.0, 0.010)  # nothing predicted: nothing learnt
    assert calibration.speculative[1] == pytest.approx(3.0)
    with pytest.raises(ValueError):
        StepCalibration(rate=0.0)
