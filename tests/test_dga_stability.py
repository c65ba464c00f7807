"""The stability bound of the workers' deviations under Delayed Gradient Averaging, checked by simulation."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.reproduce.dga import deviation_threshold


def _deviation_after(a: float, beta: float, delay: int, steps: int = 3000) -> float:
    """|d| after ``steps`` of the deviation recurrence, one worker's gradient noise entering at t and leaving at t + D.

    Written from the update rule, not from the companion matrix: worker i applies
    ``g_t - g_{t-D} + mean g_{t-D}`` through heavy-ball momentum; its deviation from
    the average sees ``a * d`` (curvature times deviation) plus a unit noise impulse
    at step 0 that the delayed correction removes at step D.
    """
    d, m = 0.0, 0.0
    local = []  # this worker's deviation part of g_t: a * d_t + noise
    for t in range(steps):
        g = a * d + (1.0 if t == 0 else 0.0)
        local.append(g)
        old = local[t - delay] if t >= delay else 0.0
        m = beta * m + (g - old)
        d = d - m
        if not np.isfinite(d) or abs(d) > 1e12:
            return np.inf
    return abs(d)


@pytest.mark.parametrize("beta,delay", [(0.0, 1), (0.0, 10), (0.9, 2), (0.9, 10), (0.5, 5)])
def test_the_threshold_separates_bounded_from_growing_deviations(beta, delay):
    thr = deviation_threshold(beta, delay)
    assert _deviation_after(0.9 * thr, beta, delay) < 1e3  # below: bounded
    assert _deviation_after(1.1 * thr, beta, delay) > 1e6  # above: grows


def test_known_values():
    # No deviation without delay: the synchronous heavy-ball bound 2 (1 + beta).
    assert deviation_threshold(0.9, 0) == pytest.approx(3.8)
    # Plain SGD, D = 1: the roots of z^2 + (a - 1) z - a are 1 and -a.
    assert deviation_threshold(0.0, 1) == pytest.approx(1.0, abs=1e-3)
    # Momentum after the delayed correction narrows it as D grows.
    thr = [deviation_threshold(0.9, d) for d in (1, 2, 5, 10, 20)]
    assert all(x > y for x, y in zip(thr, thr[1:])) and thr[-1] < 0.05


def test_stability_flag_prints_the_bound_per_delay_for_the_configs_momentum(capsys):
    from experiments.reproduce import dga

    assert dga.main(["--stability", "--config.train.momentum=0.5"]) == []
    out = capsys.readouterr().out
    assert "Momentum 0.5 " in out and "synchronous heavy ball: 3.00" in out
    for d in (2, 5, 10, 20):
        assert f"D = {d}: {deviation_threshold(0.5, d):.3f} " in out
