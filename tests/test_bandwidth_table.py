"""The bandwidth table: a tiny run writes its files, its bytes are what the compressors send, the models count right."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compjax as cj
from experiments import imagenet_models, records
from experiments.configs import bandwidth_table as bt_config
from experiments.reproduce import bandwidth_table as bt
from tests.helpers import AXIS, files_under, run_workers, stack

#: parameters of the full models: torchvision's resnet18 / resnet50 and timm's swin_large_patch4_window7_224.
FULL_COUNTS = {"resnet18": 11_689_512, "resnet50": 25_557_032, "swin_large": 196_532_476}
#: the committed table (read before any test moves records.RESULTS)
COMMITTED = records.RESULTS / "reproduce" / "bandwidth_table.json"
CONFIG = bt_config.get_config()


@pytest.fixture(scope="module")
def small_run(roots):
    """One --small run with the default output: (its folder, its result, the two roots)."""
    res = bt.main(["--small"])
    return roots[0] / "reproduce", res


@pytest.mark.slow  # a small benchmark run
def test_small_run_writes_table_json_and_plot_under_runs(small_run, roots):
    out, res = small_run
    assert files_under(roots[0]) == [f"reproduce/bandwidth_table.{ext}" for ext in ("json", "md", "png")]
    assert files_under(roots[1]) == []  # the committed table is written only with --publish
    md = (out / "bandwidth_table.md").read_text()
    assert (out / "bandwidth_table.png").stat().st_size > 10_000
    on_disk = json.loads((out / "bandwidth_table.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(res["rows"]))
    assert on_disk["config"] == json.loads(json.dumps(CONFIG.to_dict()))
    assert on_disk["command"] == on_disk["provenance"]["command"] == "python -m experiments.reproduce.bandwidth_table --small"
    assert "Regenerate: `python -m experiments.reproduce.bandwidth_table --small`" in md
    # one row per (model, compressor, network, workers); every compressor row in each model's table
    assert len(res["rows"]) == len(CONFIG.models) * len(bt.COMPRESSORS) * len(CONFIG.networks) * len(CONFIG.workers)
    for m in CONFIG.models:
        assert f"## {m['label']}:" in md
    assert md.count("\n| qsgd 256 |") == len(CONFIG.models)
    # ratios against the dense all-reduce of the same model
    dense = {s["model"]: s["bytes"] for s in res["compressors"] if s["compressor"] == bt.BASELINE}
    for s in res["compressors"]:
        assert s["ratio"] == pytest.approx(dense[s["model"]] / s["bytes"])
        assert s["bytes"] == sum(b for _, b in s["collectives"]) == sum(s["bytes_by_kind"].values())
    # the baseline's speedup is 1 and the model's numbers are the network model's
    for r in res["rows"]:
        if r["compressor"] == bt.BASELINE:
            assert r["speedup"] == pytest.approx(1.0)
        assert r["no_overlap_s"] == pytest.approx(r["compute_s"] + r["comm_s"])


def _row_bytes(res, model_label, compressor):
    (s,) = [s for s in res["compressors"] if s["model"] == model_label and s["compressor"] == compressor]
    rows = [r for r in res["rows"] if r["model"] == model_label and r["compressor"] == compressor]
    assert {r["bytes"] for r in rows} == {s["bytes"]}
    return s["bytes"]


#: One compressor per wire format (dense all-reduce, gathered cast, sparse, low-rank, packed bits); every
#: compressor's payload_bytes equals its audited bytes in the shared battery.
WIRE_FORMATS = ["identity", "cast bf16", "topk 1%", "powersgd r2", "onebit"]


@pytest.mark.slow  # the small benchmark run
@pytest.mark.parametrize("compressor", WIRE_FORMATS)
def test_row_bytes_equal_payload_bytes_of_a_real_step(small_run, compressor, mesh):
    """The table's bytes (traced on an abstract mesh) = what the compressor says it sent in a step on 8 workers."""
    _, res = small_run
    label, tiny = CONFIG.models[2]["label"], CONFIG.models[2]["small"]  # Swin: the tiny model with the fewest parameters
    shapes = imagenet_models.param_shapes(tiny)
    tx = bt.COMPRESSORS[compressor](AXIS)
    n = mesh.shape[AXIS]
    rng = np.random.default_rng(0)
    grads = stack([jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes) for _ in range(n)])
    state = stack([tx.init(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))] * n)
    _, new_state = run_workers(tx, grads, state, "shard_map", mesh)
    sent = cj.payload_bytes(new_state)
    assert np.all(sent == sent[0])
    assert _row_bytes(res, label, compressor) == int(sent[0])


@pytest.mark.slow
def test_trace_counts_what_the_compiled_program_sends(mesh):
    """trace_collectives against cj.audit_collectives of the same program: the same bytes per collective kind.

    (XLA may merge independent all-reduces, e.g. PowerSGD's P with its dense vectors, so the counts of
    collectives can differ; the bytes cannot.)
    """
    shapes = imagenet_models.param_shapes("swin_tiny")
    for name in ("topk 1%", "powersgd r2", "terngrad"):
        tx = bt.COMPRESSORS[name](AXIS)
        traced = bt.trace_collectives(tx, shapes)
        audited = bt.audit(tx, shapes)
        assert bt._by_kind(traced) == bt._by_kind(audited), name
        assert sum(c.bytes for c in traced) == sum(c.bytes for c in audited) > 0


def test_trace_refuses_collectives_under_a_branch():
    # Two layers are enough for the branch (DGC's warm-up); a full model's trace costs ~10 s on 2 cores.
    shapes = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32), "b": jax.ShapeDtypeStruct((64,), jnp.float32)}
    with pytest.raises(ValueError, match="warmup_steps=0"):
        bt.trace_collectives(cj.dgc(0.001, warmup_steps=10, axis_name=AXIS, skip_nonfinite=False), shapes)


@pytest.mark.parametrize("name", sorted(FULL_COUNTS))
def test_full_model_parameter_counts(name):
    """Built under eval_shape (nothing allocated): the counts of the reference implementations."""
    assert imagenet_models.count_params(imagenet_models.param_shapes(name)) == FULL_COUNTS[name]


def test_committed_table_matches_the_definitions():
    """The committed full table was made with the models as defined now (no stale counts)."""
    if not COMMITTED.exists():
        pytest.skip("no committed table")
    res = json.loads(COMMITTED.read_text())
    assert not res["meta"]["small"]
    assert {m["definition"]: m["parameters"] for m in res["models"]} == FULL_COUNTS
    dense = {s["model"]: s["bytes"] for s in res["compressors"] if s["compressor"] == "identity"}
    assert dense == {m["label"]: 4 * FULL_COUNTS[m["definition"]] for m in CONFIG.models}


@pytest.mark.slow  # builds every model family (about 14 s)
def test_the_model_families_run_forward():
    """Small members of each family run (projection shortcuts, bottlenecks, shifted and unshifted windows)."""
    from flax import nnx

    im = imagenet_models
    builders = [
        lambda r: im.ResNet(im.BasicBlock, (1, 1), 10, width=4, rngs=r),
        lambda r: im.ResNet(im.Bottleneck, (1, 1), 10, width=2, rngs=r),
        # 8x8 patches, window 4: a shifted block (with its mask), then a 4x4 stage that is one window
        lambda r: im.SwinTransformer(image_size=16, patch=2, embed_dim=8, depths=(2, 1), heads=(1, 2), window=4,
                                     num_classes=10, rngs=r),
    ]
    rng = np.random.default_rng(0)
    for build in builders:
        # abstract build, then random values: eager initializers compile once per shape (seconds on CPU)
        graphdef, state = nnx.split(nnx.eval_shape(lambda b=build: b(nnx.Rngs(0))))
        state = jax.tree.map(lambda x: (0.1 * rng.standard_normal(x.shape)).astype(x.dtype), state)
        model = nnx.merge(graphdef, state)
        y = model(np.ones((2, 16, 16, 3), np.float32))
        assert y.shape == (2, 10) and np.all(np.isfinite(np.asarray(y)))
    assert model.layers[1].shift == 2 and model.layers[3].window == 4 and model.layers[3].shift == 0


def test_bad_model_name():
    with pytest.raises(ValueError, match="name"):
        imagenet_models.param_shapes("resnet1000")


@pytest.mark.slow  # the small benchmark run
def test_publish_writes_the_committed_folder_with_the_overrides(small_run, monkeypatch, tmp_path):
    """--publish writes under experiments/results/reproduce only; --config.KEY=VALUE reaches the table.

    (The traces are cached from the small run: this recomputes only the network model, the tables and the plot.)
    """
    runs, results = tmp_path / "runs", tmp_path / "results"
    monkeypatch.setattr(records, "RUNS", runs)
    monkeypatch.setattr(records, "RESULTS", results)
    res = bt.main(["--small", "--publish", "--config.workers=4,16", "--config.networks=ethernet_10g"])
    assert files_under(results) == [f"reproduce/bandwidth_table.{ext}" for ext in ("json", "md", "png")]
    assert files_under(runs) == []
    assert {(r["network"], r["workers"]) for r in res["rows"]} == {("ethernet_10g", 4), ("ethernet_10g", 16)}
    def traced(summary):  # what the traces give, without the hiding bandwidths per worker count
        return [{k: v for k, v in s.items() if "[n=" not in k} for s in summary["compressors"]]

    assert traced(res) == traced(small_run[1])
    assert all({k for k in s if "[n=" in k} == {"hiding_bandwidth[n=4]", "hiding_bandwidth[n=16]"}
               for s in res["compressors"])
    md = (results / "reproduce" / "bandwidth_table.md").read_text()
    assert "hides at, n=4 / 16 (Gbit/s) | 10 GbE, n=4 | 10 GbE, n=16 |" in md and "1 GbE, n=" not in md
    assert "| no latency | α = 20 µs (10 GbE) |\n" in md and "- 10 GbE, 16 workers: " in md
    on_disk = json.loads((results / "reproduce" / "bandwidth_table.json").read_text())
    assert on_disk["config"]["workers"] == [4, 16] and on_disk["meta"]["workers"] == [4, 16]


@pytest.mark.parametrize("arg, says", [
    ("--config.nope=1", "--config.nope: no such key"),
    ("--config.trace_workers=eight", "--config.trace_workers=eight: invalid literal for int()"),
    ("--config.workers=eight", "--config.workers=('eight',): each must be an integer >= 2"),
    ("--config.workers=1,8", "--config.workers=(1, 8): each must be an integer >= 2"),
    ("--config.networks=ethernet_3g", "--config.networks=('ethernet_3g',): each must be one of"),
    ("--config.models=1", "--config.models: each model is a dict with the keys label, definition"),
])
def test_a_bad_config_exits_with_one_line(arg, says, monkeypatch, tmp_path):
    monkeypatch.setattr(records, "RUNS", tmp_path / "runs")
    with pytest.raises(SystemExit) as e:
        bt.main(["--small", arg])
    msg = str(e.value)
    assert says in msg and "\n" not in msg and msg.startswith(bt.PROG)
    assert not (tmp_path / "runs").exists()
