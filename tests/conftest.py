"""Test fixtures.  The 8 simulated CPU devices are set up by the root ``conftest.py`` before JAX starts."""

import jax
import pytest

NUM_WORKERS = 8  # the devices the root conftest.py asks for

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
