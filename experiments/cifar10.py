"""CIFAR-10 (Krizhevsky 2009), read from the **binary version** with checks; never the pickled one.

Where the files come from, in order:

1. an explicit ``root`` (the main job's ``--data-dir``), when given: only it is
   searched, and the tarball is downloaded into it when it holds nothing;
2. the cache :data:`CACHE_DIR` (``$COMPJAX_DATA/cifar-10``, default
   ``~/.cache/compjax/cifar-10``);
3. otherwise the canonical tarball :data:`URL` (about 163 MiB) is downloaded
   into the cache.

In a folder, the extracted ``cifar-10-batches-bin/`` folder or the six ``.bin``
files directly are preferred over the tarball ``cifar-10-binary.tar.gz``.
Downloading is on by default (``download=True``); ``download=False`` forbids
it.  A download is written atomically: to a ``.part`` temp file, its MD5
checked against :data:`ARCHIVE_MD5`, then renamed into place, so a failed or
bad download leaves no file behind.  The tarball's MD5 is checked whenever it
is read (its members are read in memory with :mod:`tarfile`, nothing is
extracted to disk); extracted ``.bin`` files are checked by size.  Every label
is checked to be < 10.

Errors: :class:`~experiments.data.ChecksumError` (a ``ValueError``) for a
tarball with the wrong MD5 (a download: the URL and both digests; a file on
disk: its path, both digests and the advice to delete it);
:class:`~experiments.data.DataUnavailable` (a ``FileNotFoundError`` with a
one-line message) when the dataset is nowhere and could not be downloaded.

Each ``.bin`` file is 10000 records of 3073 bytes: one label byte, then the
32x32 image as 1024 red, 1024 green and 1024 blue bytes, each plane row-major.

References:
  Krizhevsky, "Learning Multiple Layers of Features from Tiny Images", tech.
  report, University of Toronto, 2009; https://www.cs.toronto.edu/~kriz/cifar.html.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np

from experiments.data import CACHE_ROOT, ChecksumError, DataUnavailable, fetch, file_digest

CACHE_DIR = CACHE_ROOT / "cifar-10"
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


def _check_md5(path: Path, where: str, hint: str = "") -> None:
    got = file_digest(path, "md5")
    if got != ARCHIVE_MD5:
        raise ChecksumError(f"{where}: MD5 is {got}, expected {ARCHIVE_MD5} (the tarball {URL}){hint}")


def _read_archive(path: Path, verify: bool) -> dict[str, bytes]:
    if verify:
        _check_md5(path, str(path), "; the file is corrupt, truncated or not the canonical one: "
                                    "delete it and rerun to download it again")
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
    d = Path(root) if root is not None else CACHE_DIR
    for folder in (d / FOLDER, d):
        if _has_bins(folder):
            return _read_bins(folder, verify)
    if (d / ARCHIVE).is_file():
        return _read_archive(d / ARCHIVE, verify)
    what = f"CIFAR-10 (binary version: {ARCHIVE}, or its {FOLDER}/ with data_batch_1..5.bin and test_batch.bin)"
    hints = ([f"pass --data-dir DIR holding {ARCHIVE} or its extracted {FOLDER}/"] if root is None
             else [f"put {ARCHIVE} or its extracted {FOLDER}/ into {root}"])
    if not download:
        raise DataUnavailable(what, [d], None, hints, URL)
    return _read_archive(fetch(URL, d / ARCHIVE, _check_md5, what=what, looked=[d], hints=hints), verify)


def load_cifar10(root: Path | None = None, *, download: bool = True, verify: bool = True):
    """CIFAR-10 as float32 NHWC images in [0, 1] and int32 labels.

    Args:
      root: a directory holding ``cifar-10-batches-bin/``, the six ``.bin``
        files, or ``cifar-10-binary.tar.gz`` (``--data-dir``); only it is
        searched, and the tarball is downloaded into it when it holds none of
        them.  Default: the cache directory :data:`CACHE_DIR`.
      download: when the dataset is not found, download the canonical tarball
        (:data:`URL`, about 163 MiB; the default); False raises
        :class:`~experiments.data.DataUnavailable` instead.
      verify: check the tarball's MD5 (:data:`ARCHIVE_MD5`) when the tarball is
        read, and each ``.bin`` file's size (:data:`FILE_BYTES`).  A download's
        MD5 is always checked; labels are always checked to be < 10.

    Returns:
      ``(x_train float32 (50000, 32, 32, 3), y_train int32 (50000,),
      x_test float32 (10000, 32, 32, 3), y_test int32 (10000,))``; channels
      R, G, B; training records in the order of ``data_batch_1.bin`` ... ``_5``.

    Raises:
      ChecksumError: (a ``ValueError``) the tarball's or the download's MD5
        differs from :data:`ARCHIVE_MD5`; a bad download leaves no file, a
        bad tarball on disk is left as it is (the message says to delete it).
      ValueError: a ``.bin`` file has the wrong size, a length that is not a
        multiple of 3073, or a label >= 10; the tarball lacks a batch file.
      DataUnavailable: (a ``FileNotFoundError``) the dataset is nowhere and
        could not be downloaded, or ``download`` is False; a one-line message
        with the URL, the reason and what to do.
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
