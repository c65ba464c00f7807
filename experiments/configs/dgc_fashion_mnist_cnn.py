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

    python -m experiments.reproduce.dgc --config experiments/configs/dgc_fashion_mnist_cnn.py
"""

from __future__ import annotations

import ml_collections

from experiments.configs import main_job


def get_config() -> ml_collections.ConfigDict:
    """The shared main-job settings (``train``) and the compared runs (``runs``: name, compressor options)."""
    config = ml_collections.ConfigDict()
    config.train = main_job.get_config()  # every key can be overridden: --config.train.epochs=1
    config.train.update(dataset="fashion_mnist", model="cnn", epochs=10, batch_size=256, lr=0.05, momentum=0.9,
                        weight_decay=0.0, augment=False, warmup_steps=100)
    config.train.lr_before_compressor = True  # see the module docstring
    config.seeds = (0,)  # the seeds run; the table averages every seed it finds in the records
    config.runs = [
        {"name": "baseline", "compressor": {"name": "identity"}},  # dense
        {"name": "gradient dropping", "compressor": {"name": "topk", "ratio": 0.001}},
        {"name": "DGC", "compressor": {"name": "dgc", "ratio": 0.001, "nesterov": True, "sample_ratio": 0.01},
         "sparsity_warmup_epochs": 1},
    ]
    return config
