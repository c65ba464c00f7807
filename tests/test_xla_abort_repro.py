"""Programs that made XLA:CPU's SPMD partitioner abort the process (jaxlib 0.10.2), compiled in a subprocess.

Both aborts are ``spmd_partitioner_util.cc:497] Check failed: partition_group_list.num_replica_groups() *
partition_group_list.num_devices_per_group() == device_groups.num_devices_per_group()`` (rc 134, no Python
message), in a ``jax.shard_map`` manual over the worker axis only, the other mesh axes automatic -- the
layout of ``parallel.worker_step`` on a ``data x fsdp (x tensor)`` mesh:

* a per-row gather (chunk top-k's ``take_along_axis``) of a layer reshaped into fewer rows (tiles) than its
  worker has devices, the layer sharded over ``fsdp``: compjax now holds such tiles whole on the worker's
  devices (``collectives.rows_over_worker_devices``);
* an embedding lookup (a gather) of a table sharded over ``tensor`` and ``fsdp`` with token ids split over
  the automatic axes: ``worker_step`` now holds each worker's batch whole on its devices when the mesh has
  several axes besides the worker axis, and ``data_parallel_step(specs=)`` over several fast axes holds each
  worker's chunks whole on them.

Each case compiles and runs one step in a fresh interpreter and fails on a non-zero exit, so an abort fails
the test instead of killing pytest.  The pure-JAX programs (no compjax) show where XLA stands: the layout
compjax takes compiles.  The interpreter gets the tests' XLA:CPU fast-compile flags (LLVM without its
optimization passes, the elemental emitters; see conftest.py at the root) and none of the others: both aborts
are in the SPMD partitioner, an HLO pass that runs before code generation and the same under these flags, and
the compiles take about half the time.  The LM has one block (``n_layers=1``) but in the reported SparseLoCo case: the
embedding lookup and every kernel's layout are in it, and a second block would repeat them and double the
compile.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PRELUDE = """
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
"""

#: Chunk top-k through worker_step on data=2 x fsdp=4: a 32 x 16 layer sharded P('fsdp') cut into two
#: 16 x 16 tiles (fewer than the worker's 4 devices).
TILES = """
import compjax as cj
from compjax import parallel
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
tx = optax.chain(cj.chunktopk(8, chunk=16, axis_name="data"), optax.sgd(0.1))
params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(32, 16)), jnp.float32)}
specs = {"w": P("fsdp")}
@jax.jit
def step(p, s, x):
    loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss
p, s = parallel.replicate(params, mesh, specs=specs), parallel.init_worker_state(tx, params, mesh, specs=specs)
p, s, loss = parallel.worker_step(step, mesh)(p, s, np.ones((16, 32), np.float32))
print("OK", float(loss[0]))
"""

#: The LM's own step through worker_step (token embedding by gather, kernels over fsdp and tensor).
LM = """
import dataclasses
import sys
import compjax as cj
from compjax import parallel
from experiments.lm import sharded as S
method, shape = sys.argv[1], tuple(int(v) for v in sys.argv[2].split("x"))
mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "fsdp", "tensor"))
cfg = dataclasses.replace(S.CONFIGS["tiny"], n_layers=int(sys.argv[3]))
graphdef, params = S.init(cfg)
specs = S.param_specs(cfg, mesh=mesh)
tx = {"identity": lambda: optax.chain(cj.identity(axis_name="data"), optax.adamw(1e-3)),
      "sparseloco": lambda: cj.sparseloco(optax.adamw(1e-3), sync_every=1, k=8, chunk=16, axis_name="data")}[method]()
own = S.make_train_step(graphdef, tx, donate=False)
p, s = parallel.replicate(params, mesh, specs=specs), parallel.init_worker_state(tx, params, mesh, specs=specs)
batch = np.random.default_rng(0).integers(0, cfg.vocab, size=(16, cfg.seq_len + 1)).astype(np.int32)
p, s, loss = parallel.worker_step(lambda p, s, b: own(p, s, b, None, cfg), mesh)(p, s, batch)
print("OK", float(loss[0]))
"""

#: The memory benchmark's LM (token embedding by gather, stacked blocks under scan) through
#: data_parallel_step(specs=) on data=2 x fsdp=2 x tensor=2, every parameter laid out by the logical-axis rules
#: (the embedding P('tensor', 'fsdp')): the step holds each worker's chunks whole on its devices.
DATA_PARALLEL_LM = """
import compjax as cj
from compjax import parallel
from experiments.benchmarks import memory
shapes, loss_fn = memory.abstract_model("tiny", "fp32")
mesh = memory.make_mesh((2, 2, 2))
specs = memory.tensor_specs(shapes, mesh)
rng = np.random.default_rng(0)
init = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.02, jnp.float32), shapes)
tx = optax.chain(cj.identity(axis_name="data"), optax.adamw(1e-3))
p, s = parallel.replicate(init, mesh, specs=specs), parallel.init_worker_state(tx, init, mesh, specs=specs)
ids = rng.integers(0, memory.TINY_VOCAB, size=(8, memory.SIZES["tiny"]["seq_len"] + 1)).astype(np.int32)
ids = jax.device_put(ids, NamedSharding(mesh, P(("data", "fsdp", "tensor"))))
p, s, loss = parallel.data_parallel_step(loss_fn, tx, mesh, specs=specs)(p, s, ids)
print("OK", float(loss[0]))
"""

#: Pure JAX: the gradient of an embedding lookup in a partly manual shard_map on data x fsdp x tensor, the
#: table sharded P('tensor', 'fsdp'), the ids whole on each worker's devices (argv[1] == "whole", compjax's
#: layout) or split over every device ("split": aborts with jaxlib 0.10.2).
RAW_GATHER = """
import sys
mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
ids_spec = P("data") if sys.argv[1] == "whole" else P(("data", "fsdp", "tensor"))
def body(table, ids):
    g = jax.grad(lambda t: jnp.sum(jnp.take(t[0], ids, axis=0) ** 2))(table)
    return jax.lax.psum(g, "data")
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"),
                          axis_names={"data"}))
table = jax.device_put(jnp.ones((2, 64, 32)), NamedSharding(mesh, P("data", "tensor", "fsdp")))
ids = jax.device_put(jnp.zeros((16, 8), jnp.int32), NamedSharding(mesh, ids_spec))
print("OK", float(f(table, ids).sum()))
"""


#: XLA:CPU's fast-compile flags (the test process holds them unless run with COMPJAX_TEST_CODEGEN=users).
FAST_COMPILE = ("--xla_backend_optimization_level", "--xla_cpu_use_fusion_emitters")


def compile_in_subprocess(source: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    flags = os.environ.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if f.split("=")[0] in FAST_COMPILE)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(PRELUDE + source), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def assert_ran(proc: subprocess.CompletedProcess) -> None:
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, f"exit {proc.returncode} (134: XLA aborted):\n{tail}"
    assert "OK" in proc.stdout, tail


@pytest.mark.slow  # a fresh interpreter and a compile (~10 s on 2 cores)
def test_chunk_top_k_of_a_layer_in_fewer_tiles_than_devices_compiles():
    assert_ran(compile_in_subprocess(TILES))


@pytest.mark.slow  # a fresh interpreter and the LM's compile (~20 s on 2 cores)
@pytest.mark.parametrize("method,shape,blocks", [("sparseloco", "2x4x1", 2), ("identity", "2x2x2", 1),
                                                 ("sparseloco", "2x2x2", 1)])
def test_the_lm_through_worker_step_compiles(method, shape, blocks):
    """The first case is the program that aborted as reported (SparseLoCo, data=2 x fsdp=4, the whole two-block
    tiny LM: a smaller program with the same leaf shapes compiled); the others the one-block LM."""
    assert_ran(compile_in_subprocess(LM, method, shape, str(blocks)))


@pytest.mark.slow  # a fresh interpreter (~5 s on 2 cores)
def test_the_embedding_lookup_with_ids_whole_on_each_worker_compiles():
    """The layout worker_step gives a batch on a mesh of several automatic axes, in plain JAX: it compiles
    (ids split over every device instead abort with jaxlib 0.10.2: ``RAW_GATHER`` with ``split``)."""
    assert_ran(compile_in_subprocess(RAW_GATHER, "whole"))


@pytest.mark.slow  # a fresh interpreter and the LM's compile (~15 s on 2 cores)
def test_the_lm_through_data_parallel_step_over_two_fast_axes_compiles():
    """data_parallel_step(specs=) with specs over fsdp and tensor on a model with an embedding lookup: one step
    runs (its chunks split over the host's devices aborted XLA:CPU's partitioner with jaxlib 0.10.2)."""
    assert_ran(compile_in_subprocess(DATA_PARALLEL_LM))
