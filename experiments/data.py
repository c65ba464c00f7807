"""Fashion-MNIST (Xiao, Rasul & Vollgraf 2017), read from IDX files with checksums; never unpickled.

Where each of the four files comes from (``<name>.gz``, or ``<name>``
uncompressed), in order:

1. an explicit ``root`` (the main job's ``--data-dir``), when given: only it is
   searched, and a missing file is downloaded into it;
2. the Debian package ``dataset-fashion-mnist`` (:data:`DEBIAN_DIR`,
   ``/usr/share/datasets/fashion-mnist``);
3. the cache :data:`CACHE_DIR` (``$COMPJAX_DATA/fashion-mnist``, default
   ``~/.cache/compjax/fashion-mnist``);
4. otherwise ``<name>.gz`` is downloaded from :data:`URL` into the cache.

Downloading is on by default (``download=True``); ``download=False`` forbids
it.  The MD5 of each file's **decompressed** content is checked against
:data:`FILES`: always for a download (on its ``.part`` temp file, before it is
renamed into place, so a failed or bad download leaves no file behind), and for
a file found on disk unless ``verify=False``.

Errors: :class:`ChecksumError` (a ``ValueError``) when a download or a file on
disk has the wrong MD5 or cannot be decompressed (the message names the URL or
the path, the MD5 found and the one expected, and for a file on disk says to
delete it); :class:`DataUnavailable` (a ``FileNotFoundError``) when a file is
nowhere and could not be downloaded (a one-line message: what is missing, where
it looked, why the download failed or that downloads are disabled, and what to
do).  A command line catches both and exits with ``str(err)``.

This module also holds what the three loaders (this one,
:mod:`experiments.cifar10` and :mod:`experiments.lm.data`) share: the cache root
:data:`CACHE_ROOT`, the two exceptions, and :func:`fetch` (atomic, verified,
with a :data:`TIMEOUT`).
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import secrets
import sys
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

#: Root of the download cache: ``$COMPJAX_DATA``, default ``~/.cache/compjax`` (each dataset has a folder or file in it).
CACHE_ROOT = Path(os.environ.get("COMPJAX_DATA") or Path.home() / ".cache" / "compjax").expanduser()
#: Seconds a download waits to connect, and for each read, before it gives up.
TIMEOUT = 60.0

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
CACHE_DIR = CACHE_ROOT / "fashion-mnist"
URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
DEBIAN_PACKAGE = "dataset-fashion-mnist"

#: MD5 of the decompressed IDX content of each file.
FILES = {
    "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
    "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
    "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
    "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
}


class ChecksumError(ValueError):
    """A downloaded or local data file does not have the expected digest (MD5 or sha256), or is not readable as one.

    The message (one line) names the URL or the path, the digest found and the
    one expected; for a file on disk it says to delete it (the loader then
    downloads a fresh copy).  A failed download leaves no file behind.
    """


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class DataUnavailable(FileNotFoundError):
    """A dataset's files are nowhere on disk and could not be downloaded.

    ``str(err)`` is one line: what is missing, where the loader looked, why the
    download failed (the network error) or that downloads are disabled, and
    what to do, e.g.::

        Fashion-MNIST file train-images-idx3-ubyte.gz is not available: not in
        /usr/share/datasets/fashion-mnist, /home/me/.cache/compjax/fashion-mnist, and the
        download of http://.../train-images-idx3-ubyte.gz failed ([Errno 111] Connection
        refused); to get it: apt-get install dataset-fashion-mnist, or pass --data-dir DIR
        holding the four .gz files, or connect to the internet and retry

    (here wrapped; the real message has no newline).

    Args:
      what: what is missing, e.g. ``"Fashion-MNIST file train-images-idx3-ubyte.gz"``.
      looked: the places searched, in order.
      reason: why the download failed, with the URL (``"the download of URL
        failed ([Errno 111] Connection refused)"``); None when downloads are
        disabled (``download=False``).
      hints: what the user can do besides connecting to the internet (or
        allowing downloads), most useful first.
      url: the file's URL, named in the "allow the download" hint when
        downloads are disabled.

    Attributes:
      what, looked (list of str), reason, hints (list of str), url: as given.
    """

    def __init__(self, what: str, looked: Sequence, reason: str | None, hints: Sequence[str] = (),
                 url: str | None = None):
        self.what, self.looked, self.reason, self.hints = what, [str(p) for p in looked], reason, list(hints)
        self.url = url
        if reason is None:
            of = f" of {url}" if url else ""
            why, last = "downloads are disabled (download=False)", f"allow the download{of} (download=True)"
        else:
            why, last = reason, "connect to the internet and retry"
        where = f"not in {', '.join(self.looked)}, and " if self.looked else ""
        super().__init__(_one_line(f"{what} is not available: {where}{why}; "
                                   f"to get it: {', or '.join([*self.hints, last])}"))

    def __reduce__(self):
        return type(self), (self.what, self.looked, self.reason, self.hints, self.url)


def _error_reason(err: BaseException) -> str:
    """A download error in one line: ``[Errno 111] Connection refused``, ``HTTP Error 404: Not Found``, ``timed out``."""
    if isinstance(err, urllib.error.URLError) and not isinstance(err, urllib.error.HTTPError):
        err = err.reason  # an exception or a string; str(URLError) would wrap it in <urlopen error ...>
    return _one_line(str(err) or type(err).__name__)


def file_digest(path: Path, algorithm: str = "md5") -> str:
    """Hex digest of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(url: str, dest: Path, check: Callable[[Path, str], None], *, what: str, looked: Sequence,
             hints: Sequence[str] = ()) -> Path:
    """Download ``url`` to ``dest`` atomically, verified by ``check``: ``dest`` ends up complete and checked, or absent.

    The body is streamed into a temp file ``<dest>.<pid>.<random>.part`` beside
    ``dest`` (creating ``dest``'s folder), with :data:`TIMEOUT` seconds for the
    connection and for each read, and its length checked against the
    ``Content-Length`` header; then ``check(part, "download of <url>")`` must
    return (it raises :class:`ChecksumError` otherwise), and the temp file is
    renamed to ``dest`` with :func:`os.replace`.  On any failure the temp file
    is removed.  A line ``downloading URL -> DEST`` goes to stderr first.

    Args:
      url: what to fetch.
      dest: where the file goes.
      check: ``(path, where) -> None``, raising :class:`ChecksumError` (naming
        ``where``, the digest found and the one expected) when the file is wrong.
      what, looked, hints: for the :class:`DataUnavailable` raised on failure.

    Returns:
      ``dest``.

    Raises:
      ChecksumError: from ``check``; nothing is left on disk.
      DataUnavailable: the download failed (``URLError`` / ``HTTPError``,
        timeout, refused or reset connection, an ``http.client`` error, a body
        shorter than its ``Content-Length``) or ``dest``'s folder cannot be
        written; the reason is in the message.
    """
    dest = Path(dest)
    part = dest.with_name(f"{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.part")
    print(f"downloading {url} -> {dest}", file=sys.stderr, flush=True)
    try:
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            part.touch(exist_ok=False)  # mode 0o666 & ~umask (mkstemp would give 0o600)
        except OSError as err:
            raise DataUnavailable(what, looked, f"{dest.parent} cannot be written ({_error_reason(err)})",
                                  hints) from None
        try:
            with open(part, "wb") as f, urllib.request.urlopen(url, timeout=TIMEOUT) as response:
                headers = getattr(response, "headers", None)
                expected = headers.get("Content-Length") if headers is not None else None
                size = 0
                for chunk in iter(lambda: response.read(1 << 20), b""):
                    f.write(chunk)
                    size += len(chunk)
                if expected is not None and expected.isdigit() and size != int(expected):
                    raise ConnectionError(f"the connection closed after {size} of {expected} bytes")
        except (OSError, http.client.HTTPException) as err:  # URLError, HTTPError, TimeoutError are OSErrors
            raise DataUnavailable(what, looked, f"the download of {url} failed ({_error_reason(err)})",
                                  hints) from None
        check(part, f"download of {url}")
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
    return dest


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


def _content(raw: bytes, gz: bool, where: str, hint: str = "") -> bytes:
    """The decompressed content; a gzip stream that is truncated or corrupt is a :class:`ChecksumError`."""
    if not gz:
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        raise ChecksumError(_one_line(f"{where}: not a complete gzip file ({err}){hint}")) from None


def _check(name: str, content: bytes, where: str, hint: str = "") -> None:
    got = hashlib.md5(content).hexdigest()
    if got != FILES[name]:
        raise ChecksumError(f"{where}: MD5 of the decompressed content is {got}, expected {FILES[name]}{hint}")


def _local_hint(path: Path) -> str:
    """What to do about a file on disk that fails its check."""
    if path.parent == DEBIAN_DIR:
        return f"; reinstall the package: apt-get install --reinstall {DEBIAN_PACKAGE}"
    return "; the file is corrupt, truncated or not the canonical one: delete it and rerun to download it again"


def locate(name: str, root: Path | None = None, *, download: bool = True) -> Path:
    """The path of Fashion-MNIST file ``name`` (found, or downloaded into place and checked).

    Args:
      name: a key of :data:`FILES`, e.g. ``"train-images-idx3-ubyte"``.
      root: search only this folder, and download into it.  Default: search
        :data:`DEBIAN_DIR` then :data:`CACHE_DIR`, and download into the cache.
      download: fetch ``URL + name + ".gz"`` when the file is nowhere; False
        raises instead.

    Returns:
      ``<dir>/<name>.gz`` (preferred) or ``<dir>/<name>``.

    Raises:
      DataUnavailable: the file is nowhere and ``download`` is False or the
        download failed (one-line message with the reason and what to do).
      ChecksumError: the download's MD5 is wrong (nothing is written).
    """
    dirs = [Path(root)] if root is not None else [DEBIAN_DIR, CACHE_DIR]
    for d in dirs:
        for cand in (d / f"{name}.gz", d / name):
            if cand.is_file():
                return cand
    what = f"Fashion-MNIST file {name}.gz"
    if root is None:
        hints = [f"apt-get install {DEBIAN_PACKAGE}", "pass --data-dir DIR holding the four .gz files"]
    else:
        hints = [f"put {name}.gz into {root}", f"apt-get install {DEBIAN_PACKAGE} and leave out --data-dir"]
    url = URL + f"{name}.gz"
    if not download:
        raise DataUnavailable(what, dirs, None, hints, url)

    def check(part: Path, where: str) -> None:
        _check(name, _content(part.read_bytes(), True, where), where)

    return fetch(url, (dirs[0] if root is not None else CACHE_DIR) / f"{name}.gz", check,
                 what=what, looked=dirs, hints=hints)


def load_file(name: str, root: Path | None = None, *, download: bool = True, verify: bool = True) -> np.ndarray:
    """One Fashion-MNIST file as a uint8 array, the MD5 of its decompressed content checked.

    Args:
      name: a key of :data:`FILES`, e.g. ``"t10k-labels-idx1-ubyte"``.
      root: a folder holding ``<name>.gz`` or ``<name>``; only it is searched,
        and a missing file is downloaded into it.  Default: :data:`DEBIAN_DIR`,
        then :data:`CACHE_DIR` (where a missing file is downloaded).
      download: download the file from :data:`URL` when it is nowhere (the
        default); False raises :class:`DataUnavailable` instead.
      verify: check a file found on disk against :data:`FILES` (a download is
        always checked).

    Returns:
      The IDX content as a uint8 array, e.g. ``(10000, 28, 28)`` for
      ``t10k-images-idx3-ubyte``.

    Raises:
      ChecksumError: the MD5 of the file's (or the download's) decompressed
        content differs from :data:`FILES`, or the ``.gz`` is truncated; for a
        file on disk the message says to delete it (it is never overwritten).
      DataUnavailable: the file is nowhere and could not be downloaded, or
        ``download`` is False.
      ValueError: the content is not a valid IDX file (only with ``verify=False``).
    """
    path = locate(name, root, download=download)
    hint = _local_hint(path)
    content = _content(path.read_bytes(), path.suffix == ".gz", str(path), hint)
    if verify:
        _check(name, content, str(path), hint)
    return parse_idx(content)


def load_fashion_mnist(root: Path | None = None, *, download: bool = True, verify: bool = True):
    """Fashion-MNIST as float32 images in [0, 1] of shape (N, 28, 28, 1) and int32 labels.

    Args:
      root: a folder holding the four files (``--data-dir``); only it is
        searched, and missing files are downloaded into it.  Default: the
        Debian package's :data:`DEBIAN_DIR`, then the cache :data:`CACHE_DIR`.
      download: download missing files (the default); False forbids it.
      verify: check files found on disk (downloads are always checked).

    Returns:
      ``(x_train (60000, 28, 28, 1), y_train (60000,), x_test (10000, 28, 28, 1), y_test (10000,))``.

    Raises:
      As :func:`load_file`: :class:`ChecksumError` (a ``ValueError``) and
      :class:`DataUnavailable` (a ``FileNotFoundError`` with a one-line message).
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
