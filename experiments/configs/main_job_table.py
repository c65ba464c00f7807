"""The main job's results table: every compressor on the main job's defaults (Fashion-MNIST CNN, 8 workers, 5 epochs).

    python -m experiments.reproduce.main_job

``train`` is the main-job config every run starts from; each entry of ``runs``
names the run and changes its keys (``compressor`` options and, where a
compressor needs it, the optimizer after it).  Why the settings differ where
they do: the README's notes under the table.
"""

from __future__ import annotations

import ml_collections

from experiments.configs import main_job


def get_config() -> ml_collections.ConfigDict:
    """``train`` (shared main-job settings), ``runs`` (name -> changes) and ``seeds``."""
    config = ml_collections.ConfigDict()
    config.train = main_job.get_config()  # every key can be overridden: --config.train.epochs=1
    config.seeds = (0,)
    plain_sgd = {"momentum": 0.0, "lr": 0.5}  # Karimireddy et al.'s EF-signSGD; MXNet 2-bit likewise
    config.runs = [
        {"name": "identity", "compressor": {"name": "identity"}},
        {"name": "cast", "compressor": {"name": "cast", "dtype": "bfloat16"}},
        {"name": "topk", "compressor": {"name": "topk", "ratio": 0.01}},
        {"name": "randomk", "compressor": {"name": "randomk", "ratio": 0.01}, "lr": 0.01},
        {"name": "dgc", "compressor": {"name": "dgc", "ratio": 0.001, "nesterov": True,
                                       "sparsity_warmup_steps": 234}},
        {"name": "powersgd", "compressor": {"name": "powersgd", "rank": 2}},
        {"name": "onebit", "compressor": {"name": "onebit"}},
        {"name": "signsgd", "compressor": {"name": "signsgd"}, **plain_sgd},
        {"name": "twobit", "compressor": {"name": "twobit", "threshold": 0.05}, **plain_sgd},
        {"name": "terngrad", "compressor": {"name": "terngrad"}},  # clip 2.5 sigma (paper)
        {"name": "qsgd", "compressor": {"name": "qsgd", "levels": 256}},
    ]
    return config
