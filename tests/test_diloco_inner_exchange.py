"""DiLoCo with an inner optimizer that exchanges across workers, one worker's gradient non-finite.

DiLoCo skips a worker's inner step on a non-finite gradient (``skip_nonfinite``).  Without a compjax
compressor inside the inner optimizer, the inner step runs in a loop of 0 or 1 trips (its state updated in
place); with one, the inner step's collectives must run on every worker, skipped or not, or the workers'
collectives no longer match (XLA:CPU aborts the process).  The step runs in a child process so that such an
abort fails this test instead of ending the test run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import numpy as np, jax, jax.numpy as jnp, optax, compjax as cj
    from jax.sharding import NamedSharding, PartitionSpec as P

    AXIS, n = "data", 4
    mesh = jax.make_mesh((n,), (AXIS,))
    init = {"w": jnp.ones((8, 4), jnp.float32), "b": jnp.zeros((4,), jnp.float32)}
    inner = optax.chain(cj.topk(0.5, axis_name=AXIS), optax.sgd(0.1, momentum=0.9))
    tx = cj.diloco(inner, sync_every=4, axis_name=AXIS)
    put = lambda t: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(AXIS))), t)
    params = put(jax.tree.map(lambda x: jnp.stack([x] * n), init))
    state = put(jax.tree.map(lambda x: jnp.stack([x] * n), tx.init(init)))

    def update(g, s, p):
        first = lambda t: jax.tree.map(lambda x: x[0], t)
        return jax.tree.map(lambda x: x[None], tx.update(first(g), first(s), first(p)))

    f = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    rng = np.random.default_rng(0)
    g = {k: rng.normal(size=(n,) + v.shape).astype(np.float32) for k, v in init.items()}
    g["w"][2, 1, 1] = np.nan
    u, new = f(put(g), state, params)
    print("skipped", np.asarray(new.skipped).tolist())
    print("finite", all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves((u, new))))
""")


@pytest.mark.slow  # a child process compiling a shard_map step (about 10 s)
def test_an_inner_optimizer_with_a_compressor_runs_its_collectives_on_skipped_workers_too(tmp_path: Path):
    script = tmp_path / "inner_exchange.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped [0, 0, 1, 0]" in done.stdout, done.stdout
    assert "finite True" in done.stdout, done.stdout  # the compressor's vote skipped the others' exchange
