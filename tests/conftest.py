"""Test fixtures.  The 8 simulated CPU devices are set up by the root ``conftest.py`` before JAX starts.

XLA:CPU (jaxlib 0.10.2) runs each device's part of a program, and each launch of a program, on one pool of
``max(PJRT_NPROC or the cores, devices)`` threads, and a launch that finds a device at its limit of programs
in flight waits for room on its pool thread.  With as many threads as devices, such a launch can hold the
thread that one device's part of an earlier program with collectives needs: the other devices wait in its
rendezvous for a device that never starts, and XLA aborts the process after 40 s ("Termination timeout for
`all gather ...` ... only 3 of them arrived").  It happened when a test built a model (dozens of small
programs) right after dispatching sharded steps without waiting for them.  Twice as many threads as devices
leave every device of a program a thread even while each device's launch waits.  The variable is read when
JAX's CPU client starts, after this file is loaded.
"""

import os

NUM_WORKERS = 8  # the devices the root conftest.py asks for

os.environ.setdefault("PJRT_NPROC", str(2 * NUM_WORKERS))

# On a loaded machine one device's thread can start a collective late: XLA:CPU aborts the process once the others
# have waited 20 s + 40 s ("Termination timeout ... only 6 of them arrived").  The flag raises the 40 s (read when
# the CPU client starts); subprocesses inherit it.
TIMEOUT_FLAG, COLLECTIVE_TIMEOUT_S = "--xla_cpu_collective_call_terminate_timeout_seconds", 300
if TIMEOUT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TIMEOUT_FLAG}={COLLECTIVE_TIMEOUT_S}".strip()

import jax
import pytest

jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="session")
def mesh():
    """The 8-worker data mesh over the forced CPU devices."""
    from compjax import parallel

    assert len(jax.devices()) >= NUM_WORKERS, "conftest.py must set XLA_FLAGS before JAX starts"
    return parallel.make_mesh(NUM_WORKERS)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """``records.RUNS`` and ``records.RESULTS`` moved to empty temporary folders for the module: (runs, results)."""
    from experiments import records

    base = tmp_path_factory.mktemp("roots")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(records, "RUNS", base / "runs")
        mp.setattr(records, "RESULTS", base / "results")
        yield base / "runs", base / "results"


# --- the two tiers ------------------------------------------------------------------------------------------

SLOW = "slow"  # the marker of the full tier's tests (registered in pyproject.toml)


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", default=False, dest="all_tiers",
                     help="run the full tier: the tests marked slow too (CI runs them); without it, the fast "
                          "tier")


def pytest_report_header(config):
    if config.getoption("all_tiers"):
        return "tiers: the full tier (--all): every test, those marked slow included"
    return "tiers: the fast tier: the tests marked slow are left out (deselected); --all runs them too"


def pytest_collection_modifyitems(config, items):
    """Without ``--all``, deselect the tests marked ``slow`` (a parametrized case may carry it alone)."""
    if config.getoption("all_tiers"):
        return
    slow = [item for item in items if item.get_closest_marker(SLOW)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker(SLOW)]


# --- the code users get ----------------------------------------------------------------------------------------

USERS_CODEGEN = "users_codegen"  # the marker (registered in pyproject.toml)


def pytest_pyfunc_call(pyfuncitem):
    """Run a test marked ``users_codegen`` in a new pytest process without XLA:CPU's fast-compile flags.

    The tests compile with flags that make XLA:CPU compile fast (conftest.py at the root); a test whose claim
    holds for the code XLA compiles by default (two programs equal to 1e-6 where XLA's fusions decide the
    rounding, say) and whose programs are compiled where ``compiler_options`` cannot reach (a user's step built
    inside the code under test) is marked, and runs in a process started with ``COMPJAX_TEST_CODEGEN=users``.
    """
    if pyfuncitem.get_closest_marker(USERS_CODEGEN) is None or os.environ.get("COMPJAX_TEST_CODEGEN") == "users":
        return None
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_ADDOPTS"))}
    env["COMPJAX_TEST_CODEGEN"] = "users"
    root = pyfuncitem.config.rootpath
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--all",
                          pyfuncitem.nodeid], cwd=root, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid} in a process with XLA's default code generation "
                    f"(exit {out.returncode}):\n{out.stdout[-6000:]}\n{out.stderr[-2000:]}", pytrace=False)
    return True
