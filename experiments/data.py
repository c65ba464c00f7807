"""Fashion-MNIST (Xiao, Rasul & Vollgraf 2017), read from IDX files with checksums; never unpickled.

Where the files come from, in order: an explicit ``root``; the Debian package
``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``); a cache
directory (``~/.cache/compjax/fashion-mnist``), downloading the canonical files
into it when ``download=True``.  The MD5 of each file's **decompressed** content
is always checked against the published one.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import urllib.request
from pathlib import Path

import numpy as np

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
CACHE_DIR = Path(os.environ.get("COMPJAX_DATA", Path.home() / ".cache" / "compjax")) / "fashion-mnist"
URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"

#: MD5 of the decompressed IDX content of each file.
FILES = {
    "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
    "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
    "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
    "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
}


class ChecksumError(ValueError):
    """A data file's content does not have the expected MD5."""


def parse_idx(raw: bytes) -> np.ndarray:
    """Parse an IDX file (big-endian header, unsigned bytes) into a uint8 array."""
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError("not an IDX file of unsigned bytes")
    ndim = raw[3]
    dims = np.frombuffer(raw, ">u4", count=ndim, offset=4).astype(int)
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"IDX header says {tuple(dims)} but holds {data.size} bytes")
    return data.reshape(tuple(dims))


def _read(path: Path) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    return gzip.decompress(raw) if path.suffix == ".gz" else raw


def _locate(name: str, root: Path | None, download: bool) -> Path:
    dirs = [Path(root)] if root is not None else [DEBIAN_DIR, CACHE_DIR]
    for d in dirs:
        for cand in (d / f"{name}.gz", d / name):
            if cand.exists():
                return cand
    if root is None and download:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        dest = CACHE_DIR / f"{name}.gz"
        urllib.request.urlretrieve(URL + f"{name}.gz", dest)
        return dest
    raise FileNotFoundError(
        f"{name}(.gz) not found in {[str(d) for d in dirs]}: install the Debian package "
        "dataset-fashion-mnist or pass download=True"
    )


def load_file(name: str, root: Path | None = None, *, download: bool = False, verify: bool = True) -> np.ndarray:
    """One Fashion-MNIST file as a uint8 array, its decompressed MD5 checked.

    Raises:
      ChecksumError: the content's MD5 differs from :data:`FILES`.
      FileNotFoundError: the file is nowhere and ``download`` is False.
    """
    path = _locate(name, root, download)
    raw = _read(path)
    if verify:
        got = hashlib.md5(raw).hexdigest()
        if got != FILES[name]:
            raise ChecksumError(f"{path}: MD5 of the decompressed content is {got}, expected {FILES[name]}")
    return parse_idx(raw)


def load_fashion_mnist(root: Path | None = None, *, download: bool = False, verify: bool = True):
    """Fashion-MNIST as float32 images in [0, 1] of shape (N, 28, 28, 1) and int32 labels.

    Returns:
      ``(x_train (60000, 28, 28, 1), y_train (60000,), x_test (10000, 28, 28, 1), y_test (10000,))``.
    """
    def images(name):
        return (load_file(name, root, download=download, verify=verify).astype(np.float32) / 255.0)[..., None]

    def labels(name):
        return load_file(name, root, download=download, verify=verify).astype(np.int32)

    return (
        images("train-images-idx3-ubyte"),
        labels("train-labels-idx1-ubyte"),
        images("t10k-images-idx3-ubyte"),
        labels("t10k-labels-idx1-ubyte"),
    )
