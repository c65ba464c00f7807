"""Test setup: 8 CPU devices, set before JAX starts, so multi-worker code runs without a GPU."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

jax.config.update("jax_enable_x64", False)

NUM_WORKERS = 8


@pytest.fixture(scope="session")
def mesh():
    """The 8-worker data mesh over the forced CPU devices."""
    from compjax import parallel

    assert len(jax.devices()) >= NUM_WORKERS, "conftest must set XLA_FLAGS before JAX starts"
    return parallel.make_mesh(NUM_WORKERS)
