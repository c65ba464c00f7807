"""DiLoCo and Streaming DiLoCo on a character-level transformer (Tiny Shakespeare), 4 workers, on CPU.

Six runs with the same model, data, steps, seed and inner learning-rate
schedule: data-parallel AdamW, DiLoCo (H = 50), Streaming DiLoCo (2 fragments,
E3M0 outer gradients), DiLoCo with top-k outer gradients, and DiLoCo with a
Muon inner optimizer beside data-parallel Muon.  About 5 minutes on a 2-core CPU:

    python -m experiments.reproduce.diloco --config experiments/configs/diloco_tiny_shakespeare.py
    python -m experiments.reproduce.diloco --config.train.steps=100 --rows data-parallel diloco   # a quick look

Every key can be overridden with ``--config.KEY=VALUE``.
"""

from __future__ import annotations

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    """The run shared by every row (``train``), the inner schedule, and each row's outer settings."""
    config = ml_collections.ConfigDict()
    # The keyword arguments of experiments.lm.train.train, the same for every row.
    config.train = ml_collections.ConfigDict({
        "model_config": "tiny", "steps": 600, "workers": 4, "batch_per_worker": 16, "seq_len": 64,
        "eval_every": 100, "eval_batches": 8, "seed": 0,
    })
    config.lr = 3e-3  # AdamW's peak: linear warm-up, cosine decay to lr / 10 at the last step
    config.warmup_steps = 50  # or a quarter of a shorter run
    config.weight_decay = 0.1  # AdamW's
    config.sync_every = 50  # H: inner steps between outer steps (the plain DiLoCo rows)
    # Streaming DiLoCo: its own H (sync_every; 0 takes the rows' H above); fragments synced at offsets 0,
    # H / fragments, ...; overlap tau; mixing alpha; outer
    # Nesterov SGD (momentum 0.9) at outer_lr; outer gradients as 4-bit E3M0 without error feedback.
    config.streaming = ml_collections.ConfigDict({"sync_every": 0, "fragments": 2, "overlap": 1, "alpha": 0.5,
                                                  "outer_lr": 0.4})
    config.topk_ratio = 0.05  # DiLoCo + top-k: outer gradients through cj.topk(ratio) with error feedback
    config.muon_lr = 0.02  # the Muon rows: Muon's peak for the matrices (AdamW's schedule for the rest)
    return config
