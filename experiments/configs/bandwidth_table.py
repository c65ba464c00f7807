"""The seed's bandwidth table: ResNet-18, ResNet-50 and Swin-L gradients on 1 and 10 GbE, 8 and 64 workers.

    python -m experiments.reproduce.bandwidth_table --config experiments/configs/bandwidth_table.py
    python -m experiments.reproduce.bandwidth_table --config.workers=8,16,32   # other worker counts

Every key can be overridden with ``--config.KEY=VALUE`` (tuples as
``--config.workers=8,64``); the models (``models``: a tuple of dicts) are
changed by a config file of your own that starts from this one.  The
compressors compared are the script's ``COMPRESSORS``.
"""

from __future__ import annotations

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    """The models (with the seed's iteration times), the networks and the worker counts of the table."""
    config = ml_collections.ConfigDict()
    # label; definition: a name in experiments.imagenet_models.MODELS (small: the one --small uses);
    # compute_s: the seed's iteration time on an RTX 2080 Ti at batch 32; seed_parameters: the seed's count.
    config.models = (
        {"label": "ResNet-18", "definition": "resnet18", "small": "resnet18_tiny", "compute_s": 0.137,
         "seed_parameters": 11.69e6},
        {"label": "ResNet-50", "definition": "resnet50", "small": "resnet50_tiny", "compute_s": 0.330,
         "seed_parameters": 24.46e6},
        {"label": "Swin-L", "definition": "swin_large", "small": "swin_tiny", "compute_s": 0.940,
         "seed_parameters": 98.20e6},
    )
    config.networks = ("ethernet_1g", "ethernet_10g")  # compjax.netmodel.Network presets
    config.workers = (8, 64)
    # Size of the abstract mesh the updates are traced on (compjax's per-worker bytes do not depend on it).
    config.trace_workers = 8
    return config
