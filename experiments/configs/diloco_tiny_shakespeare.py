"""DiLoCo and Streaming DiLoCo on a character-level transformer (Tiny Shakespeare), 4 workers, on CPU.

Ten runs with the same model, data, steps, seed and inner learning-rate
schedule: data-parallel AdamW, DiLoCo (H = 50), Streaming DiLoCo (H = 13,
4 fragments, E3M0 outer gradients; and the same sharded over 2 devices per worker), DiLoCo with top-k outer gradients,
SparseLoCo (H = 15 and H = 50: chunk top-k, 2-bit values, decayed error
feedback instead of outer momentum), DeMo (per step: DCT top-k of the
momentum, sign update), and DiLoCo with a Muon inner optimizer beside
data-parallel Muon.  Each run takes
4,800 steps of 4 workers x 8 windows of 32 characters (4.9M characters, about
5 passes over the training text).  About 8 minutes on a 2-core CPU:

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
        "model_config": "tiny", "steps": 4800, "workers": 4, "batch_per_worker": 8, "seq_len": 32,
        "eval_every": 400, "eval_batches": 32, "seed": 0,
    })
    config.lr = 3e-3  # AdamW's peak: linear warm-up, cosine decay to lr / 10 at the last step
    config.warmup_steps = 50  # or a quarter of a shorter run
    config.weight_decay = 0.1  # AdamW's
    config.sync_every = 50  # H: inner steps between outer steps (the plain DiLoCo rows)
    # Streaming DiLoCo: its own H (sync_every; 0 takes the rows' H above); fragments synced at offsets 0,
    # H / fragments, ...; overlap tau; mixing alpha; outer Nesterov SGD (momentum 0.9) at outer_lr; outer
    # gradients as 4-bit E3M0 without error feedback.  H = 13 still sends 104x fewer bytes than data-parallel
    # (8x from the 4 bits, 13x from H); outer lr 1.0 was the best or tied of 0.4 to 1.4 at H = 16 (README).
    config.streaming = ml_collections.ConfigDict({"sync_every": 13, "fragments": 4, "overlap": 1, "alpha": 0.5,
                                                  "outer_lr": 1.0})
    config.topk_ratio = 0.05  # DiLoCo + top-k: outer gradients through cj.topk(ratio) with error feedback
    # SparseLoCo (cj.sparseloco): inner AdamW as above for H steps, then outer gradients into a decayed error-feedback
    # accumulator (beta = decay), top-k entries of each chunk x chunk tile with value_bits-bit values, plain outer
    # descent at outer_lr (no momentum) on each entry averaged over the workers that sent it ("senders", the
    # reference code's aggregation; "mean", over all workers, ended at 1.8880 instead of 1.7929 at H = 15).
    # The "sparseloco" row takes sync_every, "sparseloco-h50" the rows' H.
    config.sparseloco = ml_collections.ConfigDict({"sync_every": 15, "k": 128, "chunk": 64, "value_bits": 2,
                                                   "decay": 0.95, "outer_lr": 1.0, "aggregate": "senders"})
    # DeMo (cj.demo), per step: sign update at lr (the rows' warm-up and cosine schedule), momentum decay, top-k
    # DCT coefficients of each chunk x chunk tile, values as they travel, decoupled weight decay.  Peak lr 3e-3
    # (AdamW's); 1e-3 ended at 1.8407 instead of 1.7628.
    config.demo = ml_collections.ConfigDict({"lr": 3e-3, "decay": 0.999, "k": 32, "chunk": 64, "values": "float32",
                                             "weight_decay": 0.0})
    # The sharded row ("streaming-fsdp"): Streaming DiLoCo as above, each worker a host of fsdp_fast devices over
    # which its parameters, AdamW moments and outer state are sharded (parallel.fsdp_specs) and its batch split:
    # the same numbers as the "streaming" row up to float rounding, 1/fsdp_fast of the state per device.
    config.fsdp_fast = 2
    config.muon_lr = 0.02  # the Muon rows: Muon's peak for the matrices (AdamW's schedule for the rest)
    return config
