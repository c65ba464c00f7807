"""No collective is reached by some workers only: every branch around one is taken alike on every worker.

For each algorithm with a branch (``lax.cond``, ``lax.switch``, a loop of 0 or 1 trips) around a collective
(delayed averaging's arrival, DiLoCo's fragment syncs with overlap, DiLoCo whose inner optimizer exchanges too,
SparseLoCo's, ``cj.multi_steps``' emit step, ``cj.apply_if_finite``'s vote), a subprocess trains 6 steps on 8 workers whose targets differ and 3 of which get NaN
gradients at a sync (or arrival, or emit) step, and gathers each branch predicate over the workers before the
branch (:mod:`tests.branch_probe`): the predicate of every branch that holds a collective is the same on all 8
workers at every step, and the NaNs did make a local predicate differ (the inputs really differ per worker).
DeMo has no branch around a collective (its guard selects).  XLA's collective time-out is short in the subprocess:
a predicate that differs would abort it ("Termination timeout") rather than hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ("--xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false "
         "--xla_cpu_collective_call_warn_stuck_timeout_seconds=10 "
         "--xla_cpu_collective_call_terminate_timeout_seconds=20")

#: algorithm -> the call site of its branch around a collective (None: it has none)
BRANCHES = {
    "skip": "cond@finite.py",
    "delayed_averaging": "cond@delayed.py",
    "diloco": "fori_loop@diloco.py",
    "diloco_inner_exchange": "fori_loop@diloco.py",  # its inner top-k is selected around, never skipped locally
    "sparseloco": "fori_loop@diloco.py",
    "multi_steps": "cond@multi_steps.py",
    "demo": None,
}


@pytest.mark.slow  # a subprocess compiling an 8-worker step
@pytest.mark.parametrize("name", list(BRANCHES))
def test_every_worker_takes_the_same_branch_around_a_collective(name):
    env = {**os.environ, "XLA_FLAGS": FLAGS, "PJRT_NPROC": "16", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "tests.branch_probe", name], cwd=ROOT, env=env, check=False,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]  # a predicate that differs aborts in the branch's collective
    got = json.loads(out.stdout.strip().splitlines()[-1])
    records, sites = got["records"], got["sites"]
    for site in sites:
        vectors = records[site]
        assert vectors and len(vectors) % (6 * 8) == 0, (site, len(vectors))  # every step, every device's view
        differs = [v for v in vectors if len(set(v)) != 1]
        assert not differs, f"{name}: the predicate of {site} differs across workers: {differs[:3]}"
    want = BRANCHES[name]
    if want is None:
        assert sites == [], sites
    else:
        assert any(s.startswith(want) for s in sites), sites
        taken = {v[0] for s in sites if s.startswith(want) for v in records[s]}
        assert taken == {0, 1}, taken  # the branch was taken on some steps and not on others
    local = [s for s in records if s not in sites]  # predicates without a collective inside may differ
    assert any(len(set(v)) > 1 for s in local for v in records[s]), "the NaNs made no worker's predicate differ"
