"""Where runs write their records, and what every record says about where it came from.

Runs write under ``runs/`` at the repository root (git-ignored): one file per
run, named from its config (a hash) and its start time, so runs never
overwrite each other.  Only the reproduction scripts write the committed
results under ``experiments/results/``, and only when asked (``--publish``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "runs"
RESULTS = REPO / "experiments" / "results"


def config_hash(config: dict) -> str:
    """8 hex digits of the SHA-256 of ``config`` as sorted JSON: equal configs, equal hashes."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:8]


def run_path(kind: str, name: str, config: dict, now: datetime.datetime | None = None) -> Path:
    """``runs/<kind>/<name>-<config hash>-<YYYYmmdd-HHMMSS>.jsonl``."""
    now = now or datetime.datetime.now()
    return RUNS / kind / f"{name}-{config_hash(config)}-{now:%Y%m%d-%H%M%S}.jsonl"


def git_commit() -> dict:
    """``{"commit": sha or None, "dirty": bool or None}`` of the repository holding this code."""
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip() != ""
        return {"commit": sha, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def provenance(command: str) -> dict:
    """The command, git commit, package versions and devices of this process (call after JAX starts)."""
    from importlib import metadata

    import jax

    versions = {"python": platform.python_version()}
    for pkg in ("compjax", "jax", "jaxlib", "flax", "optax", "numpy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    devices = jax.devices()
    return {
        "command": command,
        "git": git_commit(),
        "versions": versions,
        "device": {"backend": jax.default_backend(), "kind": devices[0].device_kind, "count": len(devices),
                   "processes": jax.process_count(), "host": platform.node(), "platform": sys.platform},
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def add_output_arguments(parser, sub: str) -> None:
    """Add ``--out-dir`` and ``--publish`` to a reproduction's or benchmark's parser.

    ``sub`` is the folder under the results root (``"reproduce"``,
    ``"benchmarks"``).  By default a script writes to ``runs/<sub>/``
    (git-ignored); ``--publish`` writes the committed results under
    ``experiments/results/<sub>/`` instead; ``--out-dir`` names any folder.
    Read the choice back with :func:`output_dir`.
    """
    parser.add_argument("--out-dir", type=Path, default=None,
                        help=f"where to write (default: runs/{sub}/, ignored by git; with --publish: "
                             f"experiments/results/{sub}/)")
    parser.add_argument("--publish", action="store_true",
                        help=f"write the committed results behind the README (experiments/results/{sub}/)")


def output_dir(args, sub: str) -> Path:
    """``--out-dir``, else ``experiments/results/<sub>`` with ``--publish``, else ``runs/<sub>``."""
    if args.out_dir is not None:
        return Path(args.out_dir)
    return (RESULTS if args.publish else RUNS) / sub
