"""Tiny Shakespeare (Karpathy's char-rnn corpus), character level: text, vocabulary, split and batches.

The text: 1,115,394 ASCII characters, sha256
``86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed``.
:func:`load_text` looks for it, in order:

1. an explicit path (a file, or a folder holding ``tinyshakespeare.txt``);
2. the environment variable ``COMPJAX_TINYSHAKESPEARE`` (same forms);
3. the cache file :data:`CACHE_PATH` (``$COMPJAX_DATA/tinyshakespeare.txt``,
   default ``~/.cache/compjax/tinyshakespeare.txt``).

An explicit or environment path is used alone: when its file is missing, the
text is downloaded to it; otherwise a missing text is downloaded from
:data:`URL` into the cache.  Downloading is on by default (``download=True``);
``download=False`` forbids it.  A download is written atomically (a ``.part``
temp file, its sha256 checked, then renamed into place), so a failed or bad
download leaves no file behind; a file on disk is checked whenever it is read.

Errors: :class:`ChecksumError` (a ``ValueError``; the one of
:mod:`experiments.data`) for a download or a file with the wrong sha256 (the
URL or path, both digests, and for a file on disk the advice to delete it);
:class:`DataUnavailable` (a ``FileNotFoundError`` with a one-line message, also
from :mod:`experiments.data`) when the text is nowhere and could not be
downloaded.

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.data import CACHE_ROOT, ChecksumError, DataUnavailable, fetch

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
ENV_VAR = "COMPJAX_TINYSHAKESPEARE"
#: The file name looked for in a folder given as the path.
FILE_NAME = "tinyshakespeare.txt"
#: The download cache (``$COMPJAX_DATA``, default ``~/.cache/compjax``, as the Fashion-MNIST loader).
CACHE_PATH = CACHE_ROOT / FILE_NAME
#: Fraction of the characters (from the start) in the training split.
TRAIN_FRACTION = 0.9


def _check(raw: bytes, where: str, hint: str = "") -> None:
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SHA256:
        raise ChecksumError(f"{where}: sha256 {digest} != expected {SHA256} (not the canonical Tiny Shakespeare)"
                            f"{hint}")


def _explicit(path: str | os.PathLike | None) -> Path | None:
    """The path given, else ``$COMPJAX_TINYSHAKESPEARE``; a folder means the file :data:`FILE_NAME` in it."""
    if path is None:
        path = os.environ.get(ENV_VAR) or None
    if path is None:
        return None
    path = Path(path).expanduser()
    return path / FILE_NAME if path.is_dir() else path


def locate(path: str | os.PathLike | None = None) -> Path | None:
    """The file :func:`load_text` would read (or download to), or None if it would download into the cache.

    Args:
      path: an explicit file, or a folder (meaning its ``tinyshakespeare.txt``).

    Returns:
      ``path`` if given, else ``$COMPJAX_TINYSHAKESPEARE`` if set (either one
      whether its file exists or not), else :data:`CACHE_PATH` if it exists;
      None otherwise.
    """
    explicit = _explicit(path)
    if explicit is not None:
        return explicit
    return CACHE_PATH if CACHE_PATH.is_file() else None


def load_text(path: str | os.PathLike | None = None, *, download: bool = True) -> str:
    """The Tiny Shakespeare text, its sha256 checked.

    Args:
      path: read this file (or ``<folder>/tinyshakespeare.txt``), and nothing
        else; download to it when it is missing.  Default:
        ``$COMPJAX_TINYSHAKESPEARE`` if set (used the same way), else
        :data:`CACHE_PATH`, else download (see ``download``) into
        :data:`CACHE_PATH`.
      download: when the file is missing, fetch :data:`URL` (the default; the
        sha256 is checked before the file is put in place); False raises
        :class:`DataUnavailable` instead.

    Returns:
      The text, a ``str`` of 1,115,394 characters.

    Raises:
      ChecksumError: (a ``ValueError``) the file's or the download's sha256
        differs from :data:`SHA256`; the message names the file or URL.  A bad
        download is not written; a bad file on disk is left as it is (the
        message says to delete it).
      DataUnavailable: (a ``FileNotFoundError``) the file is missing and could
        not be downloaded, or ``download`` is False; a one-line message with
        the reason and what to do (set ``$COMPJAX_TINYSHAKESPEARE``, or allow
        or retry the download).

    Examples:
      >>> from experiments.lm import data
      >>> text = data.load_text(download=False)   # doctest: +SKIP
      >>> len(text), text[:14]                    # doctest: +SKIP
      (1115394, 'First Citizen:')
    """
    found = locate(path)
    if found is None or not found.is_file():
        dest = CACHE_PATH if found is None else found
        looked = [dest]
        what = f"Tiny Shakespeare ({FILE_NAME})"
        hints = ([f"set {ENV_VAR}=FILE (a copy of the text, or a folder holding {FILE_NAME})"] if found is None
                 else [f"put the file at {found}"])
        if not download:
            raise DataUnavailable(what, looked, None, hints, URL)
        fetch(URL, dest, lambda part, where: _check(part.read_bytes(), where), what=what, looked=looked, hints=hints)
        found = dest
    raw = found.read_bytes()
    _check(raw, str(found), "; the file is corrupt, truncated or not the canonical one: "
                            "delete it and rerun to download it again")
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
