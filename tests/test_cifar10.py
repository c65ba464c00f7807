"""CIFAR-10 binary loader (small files written here; never downloads), augmentation, ResNet-20, the config."""

import hashlib
import io
import tarfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import cifar10, models
from experiments.data import ChecksumError

N_PER_FILE = 3  # records per batch file in these tests


def record(label, r, g, b):
    """One binary record: label byte, then the R, G, B planes (each 1024 bytes, row-major)."""
    planes = [np.broadcast_to(np.asarray(p, np.uint8), (32, 32)).ravel() for p in (r, g, b)]
    return bytes([label]) + np.concatenate(planes).tobytes()


def batch_bytes(seed, n=N_PER_FILE):
    """``n`` random records, and their expected (images uint8 NHWC, labels)."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, n, dtype=np.uint8)
    raw = b"".join(record(int(y), im[..., 0], im[..., 1], im[..., 2]) for im, y in zip(images, labels))
    return raw, images, labels


def all_files():
    names = cifar10.TRAIN_FILES + cifar10.TEST_FILES
    return {name: batch_bytes(i) for i, name in enumerate(names)}


def expected(files):
    def split(names):
        x = np.concatenate([files[n][1] for n in names]).astype(np.float32) / 255.0
        return x, np.concatenate([files[n][2] for n in names]).astype(np.int32)

    return (*split(cifar10.TRAIN_FILES), *split(cifar10.TEST_FILES))


def write_bins(folder, files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, (raw, _, _) in files.items():
        (folder / name).write_bytes(raw)


def write_tarball(path, files):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, (raw, _, _) in files.items():
            info = tarfile.TarInfo(f"{cifar10.FOLDER}/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    path.write_bytes(buf.getvalue())
    return hashlib.md5(buf.getvalue()).hexdigest()


def assert_loaded(got, want):
    assert [a.dtype for a in got] == [np.float32, np.int32, np.float32, np.int32]
    assert got[0].shape == (5 * N_PER_FILE, 32, 32, 3) and got[2].shape == (N_PER_FILE, 32, 32, 3)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.fixture
def small_files(monkeypatch):
    """Make the loader expect files of N_PER_FILE records."""
    monkeypatch.setattr(cifar10, "FILE_BYTES", N_PER_FILE * cifar10.RECORD_BYTES)
    return all_files()


# --- parsing -------------------------------------------------------------------------------------


def test_parse_batch_pixel_order():
    ramp = np.arange(1024).reshape(32, 32) % 256
    raw = record(7, 1, 2, 3) + record(0, ramp, 0, 255)
    images, labels = cifar10.parse_batch(raw)
    assert images.shape == (2, 32, 32, 3) and images.dtype == np.uint8
    assert labels.dtype == np.uint8 and labels.tolist() == [7, 0]
    for c in range(3):
        np.testing.assert_array_equal(images[0, ..., c], c + 1)
    np.testing.assert_array_equal(images[1, ..., 0], ramp)  # row-major plane
    np.testing.assert_array_equal(images[1, ..., 1], 0)
    np.testing.assert_array_equal(images[1, ..., 2], 255)
    assert images.flags.c_contiguous and images.flags.writeable


def test_parse_batch_rejects_bad_length_and_labels():
    with pytest.raises(ValueError, match="3073"):
        cifar10.parse_batch(record(1, 0, 0, 0)[:-1])
    with pytest.raises(ValueError, match="label"):
        cifar10.parse_batch(record(1, 0, 0, 0) + record(10, 0, 0, 0))


def test_load_extracted_folder_and_flat_bins(tmp_path, small_files):
    write_bins(tmp_path / "a" / cifar10.FOLDER, small_files)
    write_bins(tmp_path / "b", small_files)
    got_a = cifar10.load_cifar10(tmp_path / "a")
    assert_loaded(got_a, expected(small_files))
    first = small_files["data_batch_1.bin"][1][0]
    np.testing.assert_array_equal(got_a[0][0], first.astype(np.float32) / np.float32(255))
    assert_loaded(cifar10.load_cifar10(tmp_path / "b"), expected(small_files))


def test_load_from_cache_dir(tmp_path, monkeypatch, small_files):
    monkeypatch.setattr(cifar10, "CACHE_DIR", tmp_path / "cifar-10")
    write_bins(tmp_path / "cifar-10" / cifar10.FOLDER, small_files)
    assert_loaded(cifar10.load_cifar10(), expected(small_files))


def test_bin_files_checked_by_size_and_labels(tmp_path, small_files):
    write_bins(tmp_path, small_files)
    raw = small_files["data_batch_3.bin"][0]
    (tmp_path / "data_batch_3.bin").write_bytes(raw + record(1, 0, 0, 0))
    with pytest.raises(ValueError, match="data_batch_3.bin.*expected"):
        cifar10.load_cifar10(tmp_path)
    (tmp_path / "data_batch_3.bin").write_bytes(raw[:-1] + b"\x00")
    cifar10.load_cifar10(tmp_path)  # a pixel byte: any value is fine
    (tmp_path / "data_batch_3.bin").write_bytes(bytes([12]) + raw[1:])
    with pytest.raises(ValueError, match="label"):
        cifar10.load_cifar10(tmp_path)


def test_tarball_read_in_memory_with_md5(tmp_path, monkeypatch, small_files):
    md5 = write_tarball(tmp_path / cifar10.ARCHIVE, small_files)
    with pytest.raises(ChecksumError, match="MD5"):
        cifar10.load_cifar10(tmp_path)
    monkeypatch.setattr(cifar10, "ARCHIVE_MD5", md5)
    assert_loaded(cifar10.load_cifar10(tmp_path), expected(small_files))
    assert sorted(p.name for p in tmp_path.iterdir()) == [cifar10.ARCHIVE]  # nothing extracted


def test_tarball_with_wrong_member_size(tmp_path, monkeypatch, small_files):
    small_files["test_batch.bin"] = batch_bytes(99, n=N_PER_FILE + 1)
    monkeypatch.setattr(cifar10, "ARCHIVE_MD5", write_tarball(tmp_path / cifar10.ARCHIVE, small_files))
    with pytest.raises(ValueError, match="test_batch.bin.*expected"):
        cifar10.load_cifar10(tmp_path)


def test_missing_dataset_says_how_to_get_it(tmp_path, monkeypatch):
    from experiments.data import DataUnavailable

    with pytest.raises(DataUnavailable, match="cifar-10-binary.tar.gz"):
        cifar10.load_cifar10(tmp_path, download=False)
    monkeypatch.setattr(cifar10, "CACHE_DIR", tmp_path / "empty-cache")
    with pytest.raises(DataUnavailable, match="download=True") as err:
        cifar10.load_cifar10(download=False)
    assert cifar10.URL in str(err.value)
    write_bins(tmp_path / "partial", {"data_batch_1.bin": batch_bytes(0)})  # not all six files
    with pytest.raises(DataUnavailable, match="test_batch.bin"):
        cifar10.load_cifar10(tmp_path / "partial", download=False)


# --- augmentation --------------------------------------------------------------------------------


def reference_crop_flip(x, rng, pad):
    """A per-image loop with the documented draw order: row offsets, column offsets, flips."""
    n, h, w, _ = x.shape
    dy = rng.integers(0, 2 * pad + 1, n)
    dx = rng.integers(0, 2 * pad + 1, n)
    flip = rng.random(n) < 0.5
    out = np.empty_like(x)
    for i in range(n):
        p = np.zeros((h + 2 * pad, w + 2 * pad, x.shape[3]), x.dtype)
        p[pad:pad + h, pad:pad + w] = x[i]
        crop = p[dy[i]:dy[i] + h, dx[i]:dx[i] + w]
        out[i] = crop[:, ::-1] if flip[i] else crop
    return out, dy, dx, flip


def pattern(n, h, w, c=2):
    """Images whose every pixel is distinct and non-zero (zero = padding)."""
    return (1.0 + np.arange(n * h * w * c, dtype=np.float32)).reshape(n, h, w, c)


def test_random_crop_flip_matches_reference():
    x = pattern(64, 8, 6)
    out = cifar10.random_crop_flip(x, np.random.default_rng(5), pad=2)
    want, dy, dx, flip = reference_crop_flip(x, np.random.default_rng(5), 2)
    assert out.shape == x.shape and out.dtype == np.float32
    assert not np.shares_memory(out, x)
    np.testing.assert_array_equal(out, want)
    assert flip.any() and (~flip).any() and len(set(zip(dy, dx))) > 10


def test_random_crop_flip_pad0_is_identity_or_flip():
    x = pattern(32, 5, 7)
    out = cifar10.random_crop_flip(x, np.random.default_rng(1), pad=0)
    _, _, _, flip = reference_crop_flip(x, np.random.default_rng(1), 0)
    assert flip.any() and (~flip).any()
    np.testing.assert_array_equal(out[~flip], x[~flip])  # no flip, no padding: the identity
    np.testing.assert_array_equal(out[flip], x[flip][:, :, ::-1])


def test_random_crop_flip_outputs_are_shifted_windows():
    """Independent of the draw order: each output is one of the 2 (2 pad + 1)^2 crops, and all occur."""
    pad, (n, h, w) = 1, (400, 4, 4)
    x = pattern(n, h, w)
    out = cifar10.random_crop_flip(x, np.random.default_rng(0), pad=pad)
    seen = set()
    for i in range(n):
        p = np.pad(x[i], ((pad, pad), (pad, pad), (0, 0)))
        hits = [(dy, dx, f) for dy in range(2 * pad + 1) for dx in range(2 * pad + 1) for f in (0, 1)
                if np.array_equal(out[i], p[dy:dy + h, dx:dx + w][:, ::-1] if f else p[dy:dy + h, dx:dx + w])]
        assert len(hits) == 1
        seen.add(hits[0])
    assert len(seen) == 2 * (2 * pad + 1) ** 2


def test_random_crop_flip_rejects_bad_input():
    with pytest.raises(ValueError, match="N, H, W, C"):
        cifar10.random_crop_flip(np.zeros((4, 4, 3), np.float32), np.random.default_rng(0))
    with pytest.raises(ValueError, match="pad"):
        cifar10.random_crop_flip(np.zeros((1, 4, 4, 3), np.float32), np.random.default_rng(0), pad=-1)


# --- ResNet-20 -----------------------------------------------------------------------------------


def resnet_param_count(widths=(16, 32, 64), blocks=3, in_channels=3, num_classes=10):
    """He et al. 2016, Sec. 4.2: bias-free 3x3 convs each with a BN (scale, bias); option A shortcuts."""
    def conv(cin, cout):
        return 3 * 3 * cin * cout

    def bn(c):
        return 2 * c

    total, cin = conv(in_channels, widths[0]) + bn(widths[0]), widths[0]
    for width in widths:
        for _ in range(blocks):
            total += conv(cin, width) + bn(width) + conv(width, width) + bn(width)
            cin = width
    return total + widths[-1] * num_classes + num_classes


@pytest.fixture(scope="module")
def resnet():
    return models.build(0, model="resnet20")


@pytest.mark.slow
def test_resnet20_parameter_count(resnet):
    params = resnet[0]
    leaves = jax.tree.leaves(params)
    n = resnet_param_count()
    assert sum(leaf.size for leaf in leaves) == n
    assert len(leaves) == 19 + 2 * 19 + 2  # conv kernels, BN scales and biases, dense: no BatchStat
    assert all(leaf.dtype == jnp.float32 for leaf in leaves)
    assert f"{n:,} float32 parameters" in models.ResNet20.__doc__


@pytest.mark.slow
def test_resnet20_apply_and_loss(resnet):
    params, apply, loss_fn = resnet
    x = jax.random.uniform(jax.random.key(0), (4, 32, 32, 3))
    y = jnp.array([0, 3, 9, 3])
    f = jax.jit(apply)
    logits = f(params, x)
    assert logits.shape == (4, 10) and logits.dtype == jnp.float32
    assert bool(jnp.isfinite(logits).all())
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, (x, y))  # a second trace of apply
    assert np.isfinite(float(loss))
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    # The second trace above would fail (tracer leak / mutation across traces) had the first one
    # written BatchNorm updates into the template state; and nothing carries over between calls:
    np.testing.assert_array_equal(f(params, x), logits)
    # BatchNorm normalises with the batch's statistics: an image's logits depend on its batch-mates.
    other = f(params, x.at[1:].set(x[1:] * 0.5))
    assert not np.allclose(other[0], logits[0])


@pytest.mark.slow
def test_build_default_is_cnn_and_rejects_unknown_model():
    params, _, _ = models.build()
    assert sorted(params) == ["conv1", "conv2", "fc1", "fc2"]
    assert sum(leaf.size for leaf in jax.tree.leaves(params)) == 206_922
    with pytest.raises(ValueError, match="model"):
        models.build(model="nope")


def test_dgc_config():
    pytest.importorskip("ml_collections")
    from experiments.configs import dgc_cifar10_resnet20

    config = dgc_cifar10_resnet20.get_config()
    t = config.train
    assert (t.dataset, t.model, t.epochs, t.batch_size) == ("cifar10", "resnet20", 160, 128)
    assert (t.lr, t.momentum, t.weight_decay, t.warmup_steps) == (0.1, 0.9, 1e-4, 0)
    assert t.augment is True
    assert [run["compressor"]["name"] for run in config.runs] == ["identity", "topk", "dgc"]
    assert config.runs[2] == {"name": "DGC", "compressor": {"name": "dgc", "ratio": 0.001, "sample_ratio": 0.01},
                              "sparsity_warmup_epochs": 4}
