"""The Tiny Shakespeare excerpt the tests load and train on: ``tests/data/tinyshakespeare_excerpt.txt``.

The first 39,908 characters (1,490 lines, up to the end of a speech) of Tiny
Shakespeare (Karpathy's char-rnn ``input.txt``; Shakespeare's text, public
domain), committed so that the tests need no download and nothing outside the
repository.  It is not the canonical file (whose sha256 is
:data:`experiments.lm.data.SHA256`): a test that loads it through the loader
makes :data:`EXCERPT_SHA256` the expected digest first (:func:`use_excerpt`).
"""

from __future__ import annotations

from pathlib import Path

from experiments.lm import data

#: The excerpt (UTF-8, in fact ASCII; 58 distinct characters, of the full text's 65).
EXCERPT = Path(__file__).resolve().parent / "data" / "tinyshakespeare_excerpt.txt"
#: Its sha256.
EXCERPT_SHA256 = "3cc7e2022d8dd9a5cb95d6f8adebe20a1af5fc291fd5bd913e8df4214c58e469"
#: Its length in characters (= bytes).
EXCERPT_CHARS = 39_908


def use_excerpt(monkeypatch, *, env: bool = True) -> Path:
    """Make the loader accept the excerpt (its sha256 expected); with ``env``, ``$COMPJAX_TINYSHAKESPEARE`` names it.

    Args:
      monkeypatch: a ``pytest.MonkeyPatch`` (the fixture, or ``pytest.MonkeyPatch.context()`` for a wider scope).
      env: also set the environment variable, so that ``data.load_text()`` with no path reads the excerpt.

    Returns:
      The excerpt's path.
    """
    monkeypatch.setattr(data, "SHA256", EXCERPT_SHA256)
    if env:
        monkeypatch.setenv(data.ENV_VAR, str(EXCERPT))
    return EXCERPT
