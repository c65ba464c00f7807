"""DGC reproduction on Fashion-MNIST with the main job's CNN: baseline, gradient dropping and DGC at 99.9% sparsity.

The main job's defaults (8 workers, global batch 256, SGD with momentum 0.9,
learning rate 0.05 with 100 warm-up steps and cosine decay) for 10 epochs, the
setting of Lin et al. (ICLR 2018) in shape: DGC with Nesterov momentum
correction, its sparsity warm-up going 75% -> 99.6% over the first epoch, then
99.9%, its threshold found by sampling 1% of the accumulated gradient.  The
learning rate scales the local gradients before the compressor (Lin et al.,
Algorithm 1), so that what error feedback and DGC's accumulation hold is
applied with the learning rate of the step that produced it: with a cosine
schedule over 2,340 steps and an entry of a 99.9%-sparse layer sent about every
1,000 steps, applying the rate of the sending step instead delays the schedule
for DGC (the README's DGC notes give the measured effect).  Runs on CPU in
about 15 minutes:

    python -m experiments.reproduce.dgc --config fashion_mnist_cnn
"""

from __future__ import annotations

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    """The configuration: training hyper-parameters and the compared runs (``runs``, a list of dicts)."""
    config = ml_collections.ConfigDict()
    config.dataset = "fashion_mnist"
    config.model = "cnn"
    config.train_size = 60_000
    config.epochs = 10
    config.batch_size = 256  # global, split over the workers
    config.lr = 0.05
    config.momentum = 0.9
    config.weight_decay = 0.0
    config.augment = False
    config.warmup_steps = 100  # learning-rate warm-up
    config.lr_before_compressor = True  # see the module docstring
    config.runs = [
        {"compressor": "identity"},  # dense baseline
        {"compressor": "topk", "ratio": 0.001},  # gradient dropping
        {"compressor": "dgc", "ratio": 0.001, "nesterov": True, "sparsity_warmup_epochs": 1, "sample_ratio": 0.01},
    ]
    return config
