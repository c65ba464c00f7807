"""CIFAR-10 (Krizhevsky 2009), read from the **binary version** with checks; never the pickled one.

Where the files come from, in order: an explicit ``root`` (a directory holding
the extracted ``cifar-10-batches-bin/`` folder, the six ``.bin`` files
directly, or the tarball ``cifar-10-binary.tar.gz``); else the cache directory
``$COMPJAX_DATA/cifar-10`` (default ``~/.cache/compjax/cifar-10``), downloading
the canonical tarball into it when ``download=True``.  Extracted files are
preferred over the tarball.  The tarball's MD5 is checked whenever it is read
(its members are read in memory with :mod:`tarfile`, nothing is extracted to
disk); extracted ``.bin`` files are checked by size.  Every label is checked to
be < 10.

Each ``.bin`` file is 10000 records of 3073 bytes: one label byte, then the
32x32 image as 1024 red, 1024 green and 1024 blue bytes, each plane row-major.

References:
  Krizhevsky, "Learning Multiple Layers of Features from Tiny Images", tech.
  report, University of Toronto, 2009; https://www.cs.toronto.edu/~kriz/cifar.html.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import urllib.request
from pathlib import Path

import numpy as np

from experiments.data import ChecksumError

CACHE_DIR = Path(os.environ.get("COMPJAX_DATA", Path.home() / ".cache" / "compjax")) / "cifar-10"
URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
ARCHIVE = "cifar-10-binary.tar.gz"
#: MD5 of the canonical tarball (as published on the dataset's page).
ARCHIVE_MD5 = "c32a1d4ab5d03f1284b67883e8d87530"
#: The folder inside the tarball that holds the batch files.
FOLDER = "cifar-10-batches-bin"
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILES = ("test_batch.bin",)
NUM_CLASSES = 10
IMAGE_SHAPE = (32, 32, 3)
#: Bytes per record: 1 label byte + 3 * 32 * 32 image bytes.
RECORD_BYTES = 1 + 3 * 32 * 32
#: Size of each canonical ``.bin`` file: 10000 records.
FILE_BYTES = 10000 * RECORD_BYTES


def parse_batch(raw: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Parse the records of a CIFAR-10 binary batch file.

    Args:
      raw: the file's bytes, ``n`` records of :data:`RECORD_BYTES` (3073) bytes:
        a label byte, then the red, green and blue 32x32 planes, row-major.

    Returns:
      ``(images, labels)``: uint8 ``(n, 32, 32, 3)`` (NHWC, channels R, G, B)
      and uint8 ``(n,)``; fresh arrays, not views of ``raw``.

    Raises:
      ValueError: ``len(raw)`` is not a multiple of 3073, or a label is >= 10.
    """
    if len(raw) % RECORD_BYTES:
        raise ValueError(
            f"a CIFAR-10 binary batch holds records of {RECORD_BYTES} bytes, "
            f"got {len(raw)} bytes (not a multiple of {RECORD_BYTES})"
        )
    records = np.frombuffer(raw, np.uint8).reshape(-1, RECORD_BYTES)
    labels = records[:, 0].copy()
    if labels.size and int(labels.max()) >= NUM_CLASSES:
        raise ValueError(f"CIFAR-10 labels must be < {NUM_CLASSES}, found {int(labels.max())}")
    images = np.ascontiguousarray(records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return images, labels


def _md5_file(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_size(where: str, raw: bytes, verify: bool) -> None:
    if verify and len(raw) != FILE_BYTES:
        raise ValueError(
            f"{where}: {len(raw)} bytes, expected {FILE_BYTES} (10000 records of {RECORD_BYTES} bytes); "
            "is this the binary version of CIFAR-10, complete and uncorrupted?"
        )


def _read_bins(folder: Path, verify: bool) -> dict[str, bytes]:
    out = {}
    for name in TRAIN_FILES + TEST_FILES:
        raw = (folder / name).read_bytes()
        _check_size(str(folder / name), raw, verify)
        out[name] = raw
    return out


def _read_archive(path: Path, verify: bool) -> dict[str, bytes]:
    if verify:
        got = _md5_file(path)
        if got != ARCHIVE_MD5:
            raise ChecksumError(f"{path}: MD5 is {got}, expected {ARCHIVE_MD5} (the tarball {URL})")
    wanted = {f"{FOLDER}/{name}": name for name in TRAIN_FILES + TEST_FILES}
    out = {}
    with tarfile.open(path, "r:gz") as tar:
        for member in tar:  # one sequential pass over the compressed stream
            name = wanted.get(member.name)
            if name is not None and member.isfile():
                raw = tar.extractfile(member).read()
                _check_size(f"{path}:{member.name}", raw, verify)
                out[name] = raw
    missing = sorted(set(wanted.values()) - set(out))
    if missing:
        raise ValueError(f"{path}: the tarball lacks {[f'{FOLDER}/{m}' for m in missing]}")
    return out


def _has_bins(folder: Path) -> bool:
    return all((folder / name).is_file() for name in TRAIN_FILES + TEST_FILES)


def _read_raw(root: Path | None, download: bool, verify: bool) -> dict[str, bytes]:
    dirs = [Path(root)] if root is not None else [CACHE_DIR]
    for d in dirs:
        for folder in (d / FOLDER, d):
            if _has_bins(folder):
                return _read_bins(folder, verify)
        if (d / ARCHIVE).is_file():
            return _read_archive(d / ARCHIVE, verify)
    if root is None and download:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        dest = CACHE_DIR / ARCHIVE
        part = dest.with_name(dest.name + ".part")
        urllib.request.urlretrieve(URL, part)
        part.replace(dest)
        return _read_archive(dest, verify)
    how = (
        f"download {URL} into {root}" if root is not None
        else f"pass download=True to fetch {URL} into {CACHE_DIR}, or put the tarball there"
    )
    raise FileNotFoundError(
        f"CIFAR-10 (binary version) not found in {[str(d) for d in dirs]}: looked for {FOLDER}/, "
        f"the .bin files {list(TRAIN_FILES + TEST_FILES)} and {ARCHIVE}; {how}"
    )


def load_cifar10(root: Path | None = None, *, download: bool = False, verify: bool = True):
    """CIFAR-10 as float32 NHWC images in [0, 1] and int32 labels.

    Args:
      root: a directory holding ``cifar-10-batches-bin/``, the six ``.bin``
        files, or ``cifar-10-binary.tar.gz``; only it is searched.  Default:
        the cache directory :data:`CACHE_DIR`.
      download: with ``root`` None and nothing in the cache, download the
        canonical tarball (:data:`URL`, about 163 MiB) into :data:`CACHE_DIR`.
      verify: check the tarball's MD5 (:data:`ARCHIVE_MD5`) when the tarball is
        read, and each ``.bin`` file's size (:data:`FILE_BYTES`).  Labels are
        always checked to be < 10.

    Returns:
      ``(x_train float32 (50000, 32, 32, 3), y_train int32 (50000,),
      x_test float32 (10000, 32, 32, 3), y_test int32 (10000,))``; channels
      R, G, B; training records in the order of ``data_batch_1.bin`` ... ``_5``.

    Raises:
      ChecksumError: the tarball's MD5 differs from :data:`ARCHIVE_MD5`.
      ValueError: a ``.bin`` file has the wrong size, a length that is not a
        multiple of 3073, or a label >= 10; the tarball lacks a batch file.
      FileNotFoundError: the dataset is nowhere and ``download`` is False (the
        message gives the URL).
    """
    raw = _read_raw(root, download, verify)

    def split(names):
        parts = [parse_batch(raw[name]) for name in names]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        return images.astype(np.float32) / 255.0, labels.astype(np.int32)

    x_train, y_train = split(TRAIN_FILES)
    x_test, y_test = split(TEST_FILES)
    return x_train, y_train, x_test, y_test


def random_crop_flip(x: np.ndarray, rng: np.random.Generator, pad: int = 4) -> np.ndarray:
    """Random-crop-with-padding and horizontal-flip augmentation, vectorized per batch.

    Each image is zero-padded by ``pad`` pixels on every side, an ``H x W``
    window is taken at a uniformly random offset ``(dy, dx)`` in
    ``[0, 2 * pad]^2``, and the result is flipped left-right with probability
    0.5; independently per image.  ``rng`` draws, in this order: the ``N`` row
    offsets, the ``N`` column offsets (``rng.integers(0, 2 * pad + 1, N)``
    each), then the flips (``rng.random(N) < 0.5``).

    Args:
      x: float32 (or any dtype) images ``(N, H, W, C)``.
      rng: a NumPy ``Generator``.
      pad: padding in pixels (>= 0); ``pad=0`` leaves only the flips.

    Returns:
      A new array of ``x``'s shape and dtype.

    Raises:
      ValueError: ``x`` is not 4-D, or ``pad < 0``.

    References:
      He, Zhang, Ren & Sun, "Deep Residual Learning for Image Recognition",
      CVPR 2016, Sec. 4.2 (after Lee et al., "Deeply-Supervised Nets", 2015).
    """
    x = np.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"x must be (N, H, W, C), got shape {x.shape}")
    if pad < 0:
        raise ValueError(f"pad must be >= 0, got {pad}")
    n, h, w, _ = x.shape
    padded = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    dy = rng.integers(0, 2 * pad + 1, n)
    dx = rng.integers(0, 2 * pad + 1, n)
    flip = rng.random(n) < 0.5
    rows = dy[:, None] + np.arange(h)  # (N, H)
    cols = dx[:, None] + np.arange(w)  # (N, W)
    cols = np.where(flip[:, None], cols[:, ::-1], cols)
    return padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
