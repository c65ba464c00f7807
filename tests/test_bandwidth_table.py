"""The bandwidth table: a tiny run writes its files, its bytes are what the compressors send, the models count right."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import compjax as cj
from experiments import imagenet_models
from experiments.reproduce import bandwidth_table as bt
from tests.helpers import AXIS, run_workers, stack

#: parameters of the full models: torchvision's resnet18 / resnet50 and timm's swin_large_patch4_window7_224.
FULL_COUNTS = {"resnet18": 11_689_512, "resnet50": 25_557_032, "swin_large": 196_532_476}


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bandwidth_table")
    return out, bt.main(["--small", "--out-dir", str(out)])


def test_small_run_writes_table_json_and_plot(small_run):
    out, res = small_run
    md = (out / "bandwidth_table.md").read_text()
    assert (out / "bandwidth_table.png").stat().st_size > 10_000
    on_disk = json.loads((out / "bandwidth_table.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(res["rows"]))
    # one row per (model, compressor, network, workers); every compressor row in each model's table
    assert len(res["rows"]) == len(bt.MODELS) * len(bt.COMPRESSORS) * len(bt.NETWORKS) * len(bt.WORKERS)
    for label, *_ in bt.MODELS:
        assert f"## {label}:" in md
    assert md.count("\n| qsgd 256 |") == len(bt.MODELS)
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


@pytest.mark.parametrize("compressor", WIRE_FORMATS)
def test_row_bytes_equal_payload_bytes_of_a_real_step(small_run, compressor, mesh):
    """The table's bytes (traced on an abstract mesh) = what the compressor says it sent in a step on 8 workers."""
    _, res = small_run
    label, _, tiny, *_ = bt.MODELS[2]  # Swin: the tiny model with the fewest parameters
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
    shapes = imagenet_models.param_shapes("swin_tiny")
    with pytest.raises(ValueError, match="warmup_steps=0"):
        bt.trace_collectives(cj.dgc(0.001, warmup_steps=10, axis_name=AXIS, skip_nonfinite=False), shapes)


@pytest.mark.parametrize("name", sorted(FULL_COUNTS))
def test_full_model_parameter_counts(name):
    """Built under eval_shape (nothing allocated): the counts of the reference implementations."""
    assert imagenet_models.count_params(imagenet_models.param_shapes(name)) == FULL_COUNTS[name]


def test_committed_table_matches_the_definitions():
    """The committed full table was made with the models as defined now (no stale counts)."""
    path = bt.RESULTS / "bandwidth_table.json"
    if not path.exists():
        pytest.skip("no committed table")
    res = json.loads(path.read_text())
    assert not res["meta"]["small"]
    assert {m["definition"]: m["parameters"] for m in res["models"]} == FULL_COUNTS
    dense = {s["model"]: s["bytes"] for s in res["compressors"] if s["compressor"] == "identity"}
    assert dense == {label: 4 * FULL_COUNTS[full] for label, full, *_ in bt.MODELS}


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


def test_results_path_is_the_repository_folder():
    assert bt.RESULTS == Path(bt.__file__).resolve().parents[1] / "results" / "reproduce"
