"""The main job's checks that need neither JAX nor the data: the ``--mesh`` shape, the step count, the step flags.

:mod:`experiments.train` runs them on the config before JAX loads, and
:mod:`experiments.trainer` again once the devices and the data are known
(the number of workers, the steps of the run).  Every failure is one line
(``SystemExit``) naming the flag.
"""

from __future__ import annotations

__all__ = ["check_step_flags", "count_steps", "parse_mesh"]


def parse_mesh(text: str | None) -> tuple[int, int] | None:
    """``"2x4"`` -> ``(2, 4)`` (slow, fast); raise SystemExit with a one-line message if malformed."""
    if text is None:
        return None
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise SystemExit(f"--mesh {text}: expected SLOWxFAST with two integers >= 1, e.g. 2x4")
    return int(parts[0]), int(parts[1])


def count_steps(config, n_train: int) -> int:
    """Steps of the run (batches taken) for ``n_train`` images: epochs x full batches, capped by max_steps."""
    steps = n_train // config.batch_size * config.epochs
    return steps if config.max_steps is None else min(steps, config.max_steps)


def check_step_flags(config, workers: int | None, steps_total: int | None = None) -> None:
    """Validate poison_step, poison_worker and skip_batch; raise SystemExit with a one-line message.

    ``steps_total`` None (before loading the data): check against the bounds
    known without the data (max_steps, train_limit); then call again with the
    run's steps.  ``workers`` None: not known yet (every device).
    """
    at_most = "at most " if steps_total is None else ""
    if steps_total is None:
        bounds = [config.max_steps] if config.max_steps is not None else []
        if config.train_limit:
            bounds.append(count_steps(config, config.train_limit))
        steps_total = min(bounds) if bounds else None
    for flag, value in (("--poison-step", config.poison_step), ("--skip-batch", config.skip_batch)):
        if value is None:
            continue
        if value < 0:
            raise SystemExit(f"{flag} {value}: steps are counted from 0, so it must be >= 0")
        if steps_total is not None and value >= steps_total:
            raise SystemExit(f"{flag} {value}: this run has {at_most}{steps_total} steps, counted from 0, so "
                             f"it must be in [0, {steps_total})")
    if config.poison_worker is not None:
        if config.poison_step is None:
            raise SystemExit("--poison-worker needs --poison-step (the step whose batch it poisons)")
        if config.poison_worker < 0 or (workers is not None and config.poison_worker >= workers):
            raise SystemExit(f"--poison-worker {config.poison_worker} must be in [0, {workers or 'workers'}) "
                             "(the workers)")
    if config.poison_step is not None and config.poison_step == config.skip_batch:
        raise SystemExit(f"--poison-step and --skip-batch both name step {config.skip_batch}: a dropped batch "
                         "cannot be poisoned")
