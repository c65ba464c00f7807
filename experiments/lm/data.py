"""Tiny Shakespeare (Karpathy's char-rnn corpus), character level: text, vocabulary, split and batches.

The text: 1,115,394 ASCII characters, sha256
``86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed``; every
file read or downloaded is checked against it.  :func:`load_text` looks for it,
in order: an explicit path; the environment variable
``COMPJAX_TINYSHAKESPEARE``; ``shared/data/tinyshakespeare.txt`` beside the
repository checkout (:data:`SHARED_PATH`, found from this package's location,
not the working directory); the cache file :data:`CACHE_PATH`
(``$COMPJAX_DATA/tinyshakespeare.txt``, default
``~/.cache/compjax/tinyshakespeare.txt``); and otherwise downloads
:data:`URL` into that cache.

Vocabulary: the sorted set of the characters of the whole text (65 of them:
newline, space, punctuation, digits ``3``, letters), so a character's id is
its rank.

Split (as nanoGPT's ``shakespeare_char``): the first 90% of the characters
(``int(0.9 * n)`` = 1,003,854) train, the last 10% (111,540) validate.

Batches: :func:`batches` draws random windows of ``seq_len + 1`` characters
(inputs and their next-character targets) from the training split, different
windows for each worker, determined by ``(seed, step)``;
:func:`eval_windows` gives a fixed, evenly spaced set of validation windows.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
ENV_VAR = "COMPJAX_TINYSHAKESPEARE"
#: ``shared/data/tinyshakespeare.txt`` in the folder that holds the repository checkout (offline tests and CI).
SHARED_PATH = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"
#: The download cache (``$COMPJAX_DATA``, default ``~/.cache/compjax``, as the Fashion-MNIST loader).
CACHE_PATH = Path(os.environ.get("COMPJAX_DATA", Path.home() / ".cache" / "compjax")) / "tinyshakespeare.txt"
#: Fraction of the characters (from the start) in the training split.
TRAIN_FRACTION = 0.9


class ChecksumError(ValueError):
    """A Tiny Shakespeare file's sha256 is not :data:`SHA256`."""


def _check(raw: bytes, where: str) -> None:
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SHA256:
        raise ChecksumError(f"{where}: sha256 {digest} != expected {SHA256} (not the canonical Tiny Shakespeare)")


def _download(dest: Path) -> bytes:
    """Fetch :data:`URL`, check it, and write it to ``dest`` atomically (nothing is left on a mismatch)."""
    with urllib.request.urlopen(URL, timeout=60) as response:
        raw = response.read()
    _check(raw, f"download of {URL}")  # before anything is written: a bad download leaves no file
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return raw


def locate(path: str | os.PathLike | None = None) -> Path | None:
    """The file :func:`load_text` would read, or None if it would have to download.

    Args:
      path: an explicit file; returned as given (whether it exists or not).

    Returns:
      The first of ``path``, ``$COMPJAX_TINYSHAKESPEARE`` (as given),
      :data:`SHARED_PATH` and :data:`CACHE_PATH` that is set (the first two) or
      exists (the last two); None when none is.
    """
    if path is not None:
        return Path(path)
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    for cand in (SHARED_PATH, CACHE_PATH):
        if cand.is_file():
            return cand
    return None


def load_text(path: str | os.PathLike | None = None, *, download: bool = True) -> str:
    """The Tiny Shakespeare text, its sha256 checked.

    Args:
      path: read this file (no fallback).  Default: ``$COMPJAX_TINYSHAKESPEARE``
        if set (no fallback either), else :data:`SHARED_PATH`, else
        :data:`CACHE_PATH`, else download (see ``download``).
      download: when no file is found, fetch :data:`URL` into
        :data:`CACHE_PATH` (checked before it is written); False raises
        instead.

    Returns:
      The text, a ``str`` of 1,115,394 characters.

    Raises:
      ChecksumError: (a ``ValueError``) the file's or the download's sha256
        differs from :data:`SHA256`; the message names the file or URL.  A bad
        download is not written to the cache.
      FileNotFoundError: an explicit or ``$COMPJAX_TINYSHAKESPEARE`` path that
        does not exist, or no file found and ``download=False``.

    Examples:
      >>> from experiments.lm import data
      >>> text = data.load_text(download=False)   # doctest: +SKIP
      >>> len(text), text[:14]                    # doctest: +SKIP
      (1115394, 'First Citizen:')
    """
    found = locate(path)
    if found is None:
        if not download:
            raise FileNotFoundError(
                f"Tiny Shakespeare not found (set {ENV_VAR}, or put it at {SHARED_PATH} or {CACHE_PATH}); "
                "pass download=True to fetch it"
            )
        raw = _download(CACHE_PATH)
    else:
        raw = found.read_bytes()  # FileNotFoundError names the path
        _check(raw, str(found))
    return raw.decode("utf-8")


@dataclass(frozen=True)
class Vocab:
    """A character vocabulary: ``chars[i]`` is the character of id ``i``.

    Attributes:
      chars: the characters, sorted, each once.

    Examples:
      >>> from experiments.lm.data import Vocab
      >>> v = Vocab.from_text("hello")
      >>> v.chars, v.size
      ('ehlo', 4)
      >>> v.encode("hole").tolist(), v.decode(v.encode("hole"))
      ([1, 3, 2, 0], 'hole')
    """

    chars: str

    @classmethod
    def from_text(cls, text: str) -> Vocab:
        """The sorted set of the characters of ``text`` (65 for Tiny Shakespeare)."""
        return cls("".join(sorted(set(text))))

    @property
    def size(self) -> int:
        """Number of characters (ids are ``0 .. size - 1``)."""
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """Ids of the characters of ``text``: int32 array of shape ``(len(text),)``.

        Raises:
          KeyError: a character not in the vocabulary.
        """
        index = {c: i for i, c in enumerate(self.chars)}
        return np.fromiter((index[c] for c in text), dtype=np.int32, count=len(text))

    def decode(self, ids) -> str:
        """The text of an integer array of ids (any shape, read in C order)."""
        return "".join(self.chars[i] for i in np.asarray(ids).reshape(-1))


def split(tokens: np.ndarray, train_fraction: float = TRAIN_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)``: the first ``int(train_fraction * n)`` tokens and the rest (views, not copies).

    Args:
      tokens: 1-D array of ``n`` ids.
      train_fraction: in (0, 1); default 0.9 (nanoGPT's split).

    Raises:
      ValueError: ``train_fraction`` outside (0, 1).
    """
    if not 0 < train_fraction < 1:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
    n = int(train_fraction * len(tokens))
    return tokens[:n], tokens[n:]


def load_dataset(path: str | os.PathLike | None = None, *, download: bool = True):
    """``(vocab, train_tokens, val_tokens)``: :func:`load_text`, its :class:`Vocab`, encoded and :func:`split`.

    Returns:
      vocab: :class:`Vocab` of the whole text (65 characters).
      train_tokens, val_tokens: int32 arrays of shapes ``(1003854,)`` and
        ``(111540,)``.

    Raises:
      As :func:`load_text`.
    """
    text = load_text(path, download=download)
    vocab = Vocab.from_text(text)
    train, val = split(vocab.encode(text))
    return vocab, train, val


def _check_windows(tokens: np.ndarray, seq_len: int) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if len(tokens) < seq_len + 1:
        raise ValueError(f"{len(tokens)} tokens are too few for windows of seq_len + 1 = {seq_len + 1}")


def batch_at(tokens: np.ndarray, step: int, workers: int, batch_per_worker: int, seq_len: int,
             seed: int) -> np.ndarray:
    """Step ``step``'s batch of :func:`batches`: random windows of ``seq_len + 1`` tokens.

    Window starts are drawn uniformly from ``[0, len(tokens) - seq_len - 1]``
    with ``np.random.default_rng((seed, step))``, independently for every
    worker and row, so workers see different windows, and the batch depends
    only on ``(seed, step)`` (and the sizes).

    Args:
      tokens: 1-D integer array (the training split).
      step: the step index (>= 0).
      workers, batch_per_worker: leading shape of the batch.
      seq_len: tokens per input; a window holds ``seq_len + 1`` (inputs are
        ``w[:-1]``, targets ``w[1:]``).
      seed: the run's seed.

    Returns:
      int32 array of shape ``(workers, batch_per_worker, seq_len + 1)``.

    Raises:
      ValueError: ``seq_len`` < 1 or more than ``len(tokens) - 1``.
    """
    _check_windows(tokens, seq_len)
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, len(tokens) - seq_len, size=(workers, batch_per_worker))
    return np.asarray(tokens, np.int32)[starts[..., None] + np.arange(seq_len + 1)]


def batches(tokens: np.ndarray, workers: int, batch_per_worker: int, seq_len: int, seed: int,
            *, start: int = 0) -> Iterator[np.ndarray]:
    """Endless training batches: :func:`batch_at` for steps ``start, start + 1, ...``.

    Args:
      tokens: 1-D integer array (the training split).
      workers: number of workers (leading axis).
      batch_per_worker: windows per worker per step.
      seq_len: inputs per window (a window holds ``seq_len + 1`` tokens).
      seed: the run's seed; the same seed gives the same sequence of batches.
      start: the first step (to resume a run).

    Yields:
      int32 arrays of shape ``(workers, batch_per_worker, seq_len + 1)``;
      worker ``w``'s windows are ``batch[w]``.

    Raises:
      ValueError: (on the first ``next``) ``seq_len`` < 1 or too long for ``tokens``.

    Examples:
      >>> import numpy as np
      >>> from experiments.lm import data
      >>> it = data.batches(np.arange(100), workers=4, batch_per_worker=2, seq_len=8, seed=0)
      >>> b = next(it)
      >>> b.shape, b.dtype
      ((4, 2, 9), dtype('int32'))
      >>> bool((np.diff(b, axis=-1) == 1).all())   # contiguous windows
      True
    """
    step = start
    while True:
        yield batch_at(tokens, step, workers, batch_per_worker, seq_len, seed)
        step += 1


def eval_windows(tokens: np.ndarray, num_batches: int, batch_size: int, seq_len: int) -> np.ndarray:
    """A fixed validation set: ``num_batches * batch_size`` windows with evenly spaced starts.

    Starts are ``linspace(0, len(tokens) - seq_len - 1, num_batches *
    batch_size)`` rounded down, so the windows cover the split from its first
    to its last token (they overlap only when more windows are asked for than
    fit side by side).  No randomness.

    Args:
      tokens: 1-D integer array (the validation split).
      num_batches, batch_size: the leading shape.
      seq_len: inputs per window.

    Returns:
      int32 array of shape ``(num_batches, batch_size, seq_len + 1)``.

    Raises:
      ValueError: ``seq_len`` < 1 or too long for ``tokens``, or
        ``num_batches`` or ``batch_size`` < 1.
    """
    _check_windows(tokens, seq_len)
    if num_batches < 1 or batch_size < 1:
        raise ValueError(f"num_batches and batch_size must be >= 1, got {num_batches} and {batch_size}")
    starts = np.linspace(0, len(tokens) - seq_len - 1, num_batches * batch_size).astype(np.int64)
    windows = np.asarray(tokens, np.int32)[starts[:, None] + np.arange(seq_len + 1)]
    return windows.reshape(num_batches, batch_size, seq_len + 1)
