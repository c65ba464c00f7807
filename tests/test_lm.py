"""The Tiny Shakespeare language-modelling testbed (experiments/lm): data, model and the data-parallel loop."""

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import compjax as cj
from experiments.lm import data, model
from experiments.lm.train import train
from tests.tiny_shakespeare import EXCERPT, EXCERPT_CHARS, EXCERPT_SHA256, use_excerpt

REPO = Path(__file__).resolve().parents[1]
# A model small enough for a few seconds of compilation and 20 steps on 2 CPU cores.
MICRO = {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16}


@pytest.fixture(scope="module")
def text():
    """The committed excerpt (tests/data), read through the loader with its sha256 expected; never a download."""
    with pytest.MonkeyPatch.context() as mp:
        use_excerpt(mp, env=False)
        return data.load_text(EXCERPT, download=False)


@pytest.fixture(scope="module")
def raw(text):
    return text.encode("utf-8")


@pytest.fixture
def no_local(tmp_path, monkeypatch):
    """No env var, an empty cache under tmp_path, the excerpt's sha256 expected: load_text must download."""
    monkeypatch.delenv(data.ENV_VAR, raising=False)
    monkeypatch.setattr(data, "SHA256", EXCERPT_SHA256)
    monkeypatch.setattr(data, "CACHE_PATH", tmp_path / "cache" / "tinyshakespeare.txt")
    return tmp_path / "cache"


def serve(monkeypatch, payload: bytes) -> list:
    """Replace urllib.request.urlopen by one serving ``payload``; returns the list of URLs asked for."""
    asked = []

    def urlopen(url, *args, **kwargs):
        asked.append(url)
        return io.BytesIO(payload)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return asked


# ----------------------------------------------------------------------------- data: files and checksums


def test_local_file_checksum(tmp_path, raw, monkeypatch):
    """The sha256 check on a file on disk: the excerpt is refused against the canonical digest, read against its own."""
    assert len(raw) == EXCERPT_CHARS and hashlib.sha256(raw).hexdigest() == EXCERPT_SHA256  # the committed excerpt
    assert raw.startswith(b"First Citizen:\nBefore we proceed any further, hear me speak.")
    good = tmp_path / "good.txt"
    good.write_bytes(raw)
    with pytest.raises(data.ChecksumError) as err:  # not the canonical text: both digests named
        data.load_text(good, download=False)
    assert str(good) in str(err.value) and EXCERPT_SHA256 in str(err.value) and data.SHA256 in str(err.value)
    monkeypatch.setattr(data, "SHA256", EXCERPT_SHA256)
    assert hashlib.sha256(data.load_text(good).encode()).hexdigest() == data.SHA256
    monkeypatch.setenv(data.ENV_VAR, str(good))
    assert len(data.load_text(download=False)) == EXCERPT_CHARS

    bad = tmp_path / "bad.txt"
    bad.write_bytes(raw[:-1] + b"?")
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        data.load_text(bad)
    monkeypatch.setenv(data.ENV_VAR, str(bad))
    with pytest.raises(data.ChecksumError, match=re.escape(str(bad))):
        data.load_text()


#: Run in a copy of experiments/: load the text with no env var, an empty cache and download=False.
NOWHERE = """
import json, sys
from experiments.lm import data
data.SHA256 = sys.argv[1]  # the file planted beside the copy would pass the checksum
touched = []
sys.addaudithook(lambda event, args: touched.append(str(args[0])) if event in ("open", "os.listdir", "os.scandir") else None)
try:
    data.load_text(download=False)
    error = None
except data.DataUnavailable as e:
    error = str(e)
print(json.dumps({"module": data.__file__, "locate": data.locate(), "error": error, "touched": touched}, default=str))
"""


def test_never_looks_beside_the_checkout(tmp_path, monkeypatch):
    """The loader looks only at its argument, $COMPJAX_TINYSHAKESPEARE and the cache: not beside the checkout.

    experiments/ is copied to tmp_path/repo and a text the loader would accept is planted at
    tmp_path/shared/data/tinyshakespeare.txt, beside that copy.  With the env var unset, an empty cache
    ($COMPJAX_DATA, and HOME) and download=False, loading raises DataUnavailable naming the env var and the
    download, and the planted file is never opened."""
    monkeypatch.delenv(data.ENV_VAR, raising=False)
    monkeypatch.setattr(data, "CACHE_PATH", tmp_path / "cache" / data.FILE_NAME)
    assert data.locate() is None  # in this process: nothing but the (empty) cache is a candidate
    assert {k for k, v in vars(data).items() if isinstance(v, Path)} == {"CACHE_ROOT", "CACHE_PATH"}  # nowhere else

    copy = tmp_path / "repo"
    shutil.copytree(REPO / "experiments", copy / "experiments",
                    ignore=shutil.ignore_patterns("results", "runs", "__pycache__"))
    planted = tmp_path / "shared" / "data" / data.FILE_NAME
    planted.parent.mkdir(parents=True)
    shutil.copyfile(EXCERPT, planted)
    env = {k: v for k, v in os.environ.items() if k not in (data.ENV_VAR, "PYTHONPATH")}
    env |= {"COMPJAX_DATA": str(tmp_path / "cache"), "HOME": str(tmp_path / "home"), "PYTHONPATH": str(copy)}
    proc = subprocess.run([sys.executable, "-c", NOWHERE, EXCERPT_SHA256], check=False, cwd=copy, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert Path(out["module"]).is_relative_to(copy)  # the copy's loader ran
    assert out["locate"] is None
    error = out["error"]
    assert error is not None, "the text planted beside the checkout was loaded"
    assert "\n" not in error and str(tmp_path / "cache" / data.FILE_NAME) in error
    assert f"set {data.ENV_VAR}=FILE" in error and f"allow the download of {data.URL} (download=True)" in error
    assert str(tmp_path / "shared") not in error and "shared/data" not in error
    assert not [p for p in out["touched"] if (tmp_path / "shared").as_posix() in p]


def test_download_mocked(no_local, raw, monkeypatch):
    with pytest.raises(FileNotFoundError):
        data.load_text(download=False)
    asked = serve(monkeypatch, raw)
    assert data.load_text() == raw.decode()
    assert asked == [data.URL]
    assert (no_local / "tinyshakespeare.txt").read_bytes() == raw
    assert sorted(p.name for p in no_local.iterdir()) == ["tinyshakespeare.txt"]  # no leftover temp file
    # the cache is used now: no second download
    asked.clear()
    assert data.load_text() == raw.decode() and asked == []


def test_bad_download_raises_and_leaves_no_file(no_local, raw, monkeypatch):
    serve(monkeypatch, raw.replace(b"First Citizen", b"Second Citizen"))
    with pytest.raises(data.ChecksumError, match="sha256"):
        data.load_text()
    assert not no_local.exists() or list(no_local.iterdir()) == []


# ----------------------------------------------------------------------------- data: vocab, split, batches


def test_vocab_round_trip(text):
    vocab = data.Vocab.from_text(text)
    assert vocab.size == 58  # the excerpt's characters (the full text has 65)
    assert list(vocab.chars) == sorted(set(text))
    ids = vocab.encode(text[:5000])
    assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < vocab.size
    assert vocab.decode(ids) == text[:5000]
    assert vocab.encode("\n ").tolist() == [0, 1]  # the smallest characters come first


def test_split_sizes(text, monkeypatch):
    use_excerpt(monkeypatch)  # found through $COMPJAX_TINYSHAKESPEARE
    vocab, train_tokens, val_tokens = data.load_dataset(download=False)
    n = len(text)
    assert len(train_tokens) == int(0.9 * n) == 35_917
    assert len(val_tokens) == n - int(0.9 * n) == 3_991
    # the full text's split, as load_dataset's docstring states it
    assert int(0.9 * 1_115_394) == 1_003_854 and 1_115_394 - 1_003_854 == 111_540
    assert "``(1003854,)``" in data.load_dataset.__doc__ and "``(111540,)``" in data.load_dataset.__doc__
    assert vocab.decode(train_tokens[-100:]) + vocab.decode(val_tokens[:100]) == text[int(0.9 * n) - 100:
                                                                                       int(0.9 * n) + 100]


def test_windows_within_split(text):
    vocab = data.Vocab.from_text(text)
    train_tokens, val_tokens = data.split(vocab.encode(text))
    train_text, val_text = text[:len(train_tokens)], text[len(train_tokens):]
    b = data.batch_at(train_tokens, 3, workers=4, batch_per_worker=8, seq_len=64, seed=1)
    assert b.shape == (4, 8, 65) and b.dtype == np.int32
    assert all(vocab.decode(w) in train_text for w in b.reshape(-1, 65))
    v = data.eval_windows(val_tokens, 3, 8, 64)
    assert v.shape == (3, 8, 65) and v.dtype == np.int32
    windows = [vocab.decode(w) for w in v.reshape(-1, 65)]
    assert all(w in val_text for w in windows)
    assert windows[0] == val_text[:65] and windows[-1] == val_text[-65:]  # from the first to the last character
    # a tiny split: every start in range is reachable and none beyond
    starts = {int(w[0]) for s in range(50) for w in data.batch_at(np.arange(10), s, 2, 4, 7, 0).reshape(-1, 8)}
    assert starts == {0, 1, 2}


def test_batches_differ_across_workers_and_reproduce(text):
    tokens, _ = data.split(data.Vocab.from_text(text).encode(text))
    first = [next(it) for it in [data.batches(tokens, 4, 2, 32, seed=0)] for _ in range(3)]
    again = data.batches(tokens, 4, 2, 32, seed=0)
    for b in first:
        assert np.array_equal(b, next(again))
        assert all(not np.array_equal(b[i], b[j]) for i in range(4) for j in range(i))
    assert not np.array_equal(first[0], first[1])  # steps differ
    assert not np.array_equal(first[0], next(data.batches(tokens, 4, 2, 32, seed=1)))  # seeds differ
    assert np.array_equal(next(data.batches(tokens, 4, 2, 32, seed=0, start=2)), first[2])  # resumable


# ----------------------------------------------------------------------------- model


def test_model_shape_and_causality():
    params, apply, _ = model.build(MICRO)
    net = jax.jit(apply)  # the module, through its pure form (op-by-op calls are slow)
    ids = jax.random.randint(jax.random.key(0), (3, 12), 0, 65)
    logits = net(params, ids)
    assert logits.shape == (3, 12, 65) and logits.dtype == jnp.float32
    t = 7
    changed = net(params, ids.at[:, t].set((ids[:, t] + 1) % 65))
    np.testing.assert_array_equal(np.asarray(changed[:, :t]), np.asarray(logits[:, :t]))
    assert not np.allclose(changed[:, t], logits[:, t])
    assert not np.allclose(changed[:, -1], logits[:, -1])  # later positions do see it
    with pytest.raises(ValueError, match="context"):
        model.CharTransformer(65, **MICRO, rngs=nnx.Rngs(0))(jnp.zeros((1, MICRO["seq_len"] + 1), jnp.int32))


@pytest.mark.parametrize("name", ["tiny", "default"])
def test_param_count_matches_docstring(name):
    stated = re.search(rf'``"{name}"``[^*]*\*\*([\d,]+)\*\*', model.__doc__)
    assert stated, f"no count for {name!r} in the docstring"
    stated = int(stated.group(1).replace(",", ""))
    abstract = nnx.eval_shape(lambda: model.CharTransformer(65, **model.config(name), rngs=nnx.Rngs(0)))
    counted = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert counted == stated == model.NUM_PARAMS[name] == model.num_params(65, **model.config(name))


def test_precision_must_be_known():
    with pytest.raises(ValueError, match="precision"):
        model.build(MICRO, precision="bf16")


@pytest.mark.slow  # two gradients compiled (about 4 s)
def test_mixed_precision_computes_in_bfloat16_with_float32_parameters():
    """``precision="mixed"``: the same float32 parameters, bfloat16 matmuls, float32 logits and loss close to the
    float32 model's, and bfloat16 gradients (compute_cast) close to the float32 ones."""
    params, _, loss32 = model.build(MICRO)
    mixed, apply, loss16 = model.build(MICRO, precision="mixed")
    assert all(a.dtype == b.dtype == jnp.float32 for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(mixed)))
    windows = jax.random.randint(jax.random.key(0), (4, MICRO["seq_len"] + 1), 0, 65)
    assert jax.eval_shape(apply, mixed, windows[:, :-1]).dtype == jnp.float32
    dots = {str(v.aval.dtype) for e in jax.make_jaxpr(apply)(mixed, windows[:, :-1]).jaxpr.eqns
            if e.primitive.name == "dot_general" for v in e.invars}
    assert dots == {"bfloat16"}, dots
    l32, g32 = jax.jit(jax.value_and_grad(loss32))(params, windows)
    l16, g16 = jax.jit(jax.value_and_grad(loss16))(mixed, windows)
    assert abs(float(l16) - float(l32)) < 0.02, (l16, l32)
    assert {str(g.dtype) for g in jax.tree.leaves(g16)} == {"bfloat16"}
    for a, b in zip(jax.tree.leaves(g16), jax.tree.leaves(g32)):
        scale = float(jnp.max(jnp.abs(b))) + 1e-6
        assert float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))) < 0.05 * scale


def test_tree_layout_groups_blocks():
    params, _, _ = model.build(MICRO | {"n_layers": 3})
    assert sorted(params, key=str) == ["blocks", "head", "ln_f", "pos_embed", "tok_embed"]
    assert sorted(params["blocks"]) == [0, 1, 2]
    blocks = [model.block_index(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert {b for b in blocks if b is not None} == {0, 1, 2}
    assert blocks.count(None) == 5  # tok_embed, pos_embed, ln_f scale and bias, head


# ----------------------------------------------------------------------------- training


def run(text, make_tx, **kw):
    args = {"model_config": MICRO, "steps": 20, "workers": 4, "batch_per_worker": 4, "seq_len": 16,
            "eval_every": 10, "eval_batches": 2, "seed": 0, "text": text}
    return train(make_tx, **args | kw)


@pytest.mark.slow  # trains the testbed (about 8 s)
def test_train_synchronous(text):
    res = run(text, lambda ax: optax.chain(cj.identity(axis_name=ax), optax.sgd(0.1)))
    num_params = res["config"]["num_params"]
    assert res["config"]["vocab"] == len(set(text)) and num_params == model.num_params(len(set(text)), **MICRO)
    loss = res["train_loss"]
    assert len(loss) == 20 and np.mean(loss[-5:]) < np.mean(loss[:5]) - 0.3
    assert res["eval_step"] == [0, 10, 20]
    assert res["val_loss_worker0"][-1] < res["val_loss_worker0"][0] - 0.3
    assert res["param_spread"] == [0.0, 0.0, 0.0]  # data parallel: every worker applies the same mean
    assert res["val_loss_mean"] == pytest.approx(res["val_loss_worker0"], rel=1e-5)
    # the dense all-reduce of float32 gradients plus identity's 4-byte non-finite vote, read from the state
    assert res["payload_counted"] and res["payload_bytes"] == [4 * num_params + 4] * 20
    assert res["total_bytes"] == 20 * (4 * num_params + 4) and res["peak_bytes"] == 4 * num_params + 4
    assert res["compilations"] == 1 and res["eval_compilations"] == 1
    assert len(res["step_seconds"]) == 20
    assert res["config"]["devices"] == [d.id for d in jax.devices()[:4]]  # the first 4 of the 8 devices
    assert json.loads(json.dumps(res)) == res


@pytest.mark.slow  # trains the testbed sharded on 2 x 4 (about 10 s)
def test_train_mixed_precision_sharded(text):
    """``precision="mixed"`` on a 2 x 4 mesh with FSDP: the loss falls as in float32, the parameters stay float32
    and the transform is handed bfloat16 gradients."""
    seen = set()

    def make_tx(ax):
        def record(g, state, params=None):
            seen.update(str(x.dtype) for x in jax.tree.leaves(g))
            return g, state
        return optax.chain(optax.GradientTransformation(lambda p: optax.EmptyState(), record),
                           cj.identity(axis_name=ax), optax.sgd(0.1))

    res = run(text, make_tx, mesh="2x4", fsdp=True, precision="mixed", batch_per_worker=2)
    assert res["config"]["precision"] == "mixed" and seen == {"bfloat16"}
    loss = res["train_loss"]
    assert np.all(np.isfinite(loss)) and np.mean(loss[-5:]) < np.mean(loss[:5]) - 0.3
    assert res["val_loss_worker0"][-1] < res["val_loss_worker0"][0] - 0.3
    with pytest.raises(ValueError, match="precision"):
        run(text, make_tx, precision="half")


@pytest.mark.slow
def test_train_without_communication_diverges(text):
    with pytest.warns(UserWarning, match="holds no compjax compressor"):  # said when the step is built
        res = run(text, lambda ax: optax.sgd(0.1), steps=10)
    assert res["param_spread"][0] == 0.0 and res["param_spread"][-1] > 1e-3  # workers drift apart
    assert res["val_loss_mean"][-1] != res["val_loss_worker0"][-1]
    assert not res["payload_counted"] and res["payload_bytes"] == [0] * 10 and res["total_bytes"] == 0


def test_train_passes_params_to_the_transform(text):
    seen = []

    def needs_params(ax):
        def update(updates, state, params=None):
            seen.append(params is not None)
            if params is None:
                raise ValueError("params required")
            return jax.tree.map(lambda g: -0.1 * g, updates), state

        return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)

    with pytest.warns(UserWarning, match="holds no compjax compressor"):  # a bare transform: no exchange
        res = run(text, needs_params, steps=2)
    assert seen and all(seen) and len(res["train_loss"]) == 2


def test_train_rejects_bad_arguments(text):
    with pytest.raises(ValueError, match="context"):
        run(text, lambda ax: optax.sgd(0.1), seq_len=32)
    with pytest.raises(ValueError, match="num_workers"):
        run(text, lambda ax: optax.sgd(0.1), workers=len(jax.devices()) + 1)
