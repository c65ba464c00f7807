"""The stability bound of the workers' deviations under Delayed Gradient Averaging, checked by simulation."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.reproduce.dga import deviation_threshold


def _deviation_after(a: float, beta: float, delay: int, period: int = 1, steps: int = 3000) -> float:
    """|d| after ``steps`` of the deviation recurrence, one worker's gradient noise entering at t and leaving
    when its period's average arrives.

    Written from the update rule, not from the matrices: worker i applies ``g_t``, and
    at ``t = pK + K - 1 + D`` also ``- S_p + mean S_p`` (``S_p`` its gradients' sum over
    period p), through heavy-ball momentum; its deviation from the average sees
    ``a * d`` (curvature times deviation) plus a unit noise impulse at step 0.
    """
    d, m = 0.0, 0.0
    local = []  # this worker's deviation part of g_t: a * d_t + noise
    for t in range(steps):
        g = a * d + (1.0 if t == 0 else 0.0)
        local.append(g)
        end = t - delay
        old = sum(local[end - period + 1:end + 1]) if end >= period - 1 and end % period == period - 1 else 0.0
        m = beta * m + (g - old)
        d = d - m
        if not np.isfinite(d) or abs(d) > 1e12:
            return np.inf
    return abs(d)


@pytest.mark.parametrize("beta,delay,period", [(0.0, 1, 1), (0.0, 10, 1), (0.9, 2, 1), (0.9, 10, 1), (0.5, 5, 1),
                                               (0.9, 10, 20), (0.9, 10, 10), (0.9, 2, 3), (0.9, 0, 20)])
def test_the_threshold_separates_bounded_from_growing_deviations(beta, delay, period):
    """Below the bound the impulse dies out; just above it the deviation grows.  (With a period the map is
    periodic and its unstable set can be a window: 1.05 x the bound is stable again for D = 10, K = 20, so
    the check above is at 1.01 x.)"""
    thr = deviation_threshold(beta, delay, period)
    for x in (0.3, 0.6, 0.9):
        assert _deviation_after(x * thr, beta, delay, period) < 1e-3  # below: the impulse decays
    assert _deviation_after(1.01 * thr, beta, delay, period, steps=20_000) > 1e6  # above: grows


def test_known_values():
    # No deviation without delay: the synchronous heavy-ball bound 2 (1 + beta).
    assert deviation_threshold(0.9, 0) == pytest.approx(3.8)
    # Plain SGD, D = 1: the roots of z^2 + (a - 1) z - a are 1 and -a.
    assert deviation_threshold(0.0, 1) == pytest.approx(1.0, abs=1e-3)
    # Momentum after the delayed correction narrows it as D grows.
    thr = [deviation_threshold(0.9, d) for d in (1, 2, 5, 10, 20)]
    assert all(x > y for x, y in zip(thr, thr[1:])) and thr[-1] < 0.05
    # Averaging every K = 20 steps: D = 10 keeps half the synchronous range; K = D = 10 does not.
    assert deviation_threshold(0.9, 10, 20) > 1.5 and deviation_threshold(0.9, 10, 10) < 0.06


def test_stability_flag_prints_the_bound_per_delay_for_the_configs_momentum(capsys):
    from experiments.reproduce import dga

    assert dga.main(["--stability", "--config.train.momentum=0.5"]) == []
    out = capsys.readouterr().out
    assert "Momentum 0.5 " in out and "synchronous heavy ball: 3.00" in out
    for d in (2, 5, 10, 20):
        assert f"D = {d}: {deviation_threshold(0.5, d):.3f} " in out
