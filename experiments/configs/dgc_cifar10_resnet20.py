"""DGC reproduction on CIFAR-10 with ResNet-20: baseline, gradient dropping and DGC at 99.9% sparsity.

The setting of Lin et al. (ICLR 2018), Sec. 5 / Table 2 (CIFAR-10, momentum SGD,
compared with dense training and with gradient dropping), scaled to one run per
method and to ResNet-20 (He et al. 2016, Sec. 4.2; the paper's Table 2 uses
ResNet-110 on 4 GPUs).  Hyper-parameters: 160 epochs, global batch 128,
learning rate 0.1, momentum 0.9, weight decay 1e-4, random crop (pad 4) and
horizontal flip, no learning-rate warm-up.  DGC's sparsity warm-up goes
75% -> 99.9% over the first 4 epochs, its threshold found by sampling 1% of the
accumulated gradient (the authors' code).  The script below turns each run
into main-job arguments (:mod:`experiments.train`).

Meant for GPU runs, not CPU (each run is about 62,500 steps of batch 128):

    python -m experiments.reproduce.dgc --config cifar10_resnet20

References:
  Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression: Reducing the
  Communication Bandwidth for Distributed Training", ICLR 2018.  Aji &
  Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017
  (gradient dropping).  He, Zhang, Ren & Sun, "Deep Residual Learning for Image
  Recognition", CVPR 2016.
"""

from __future__ import annotations

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    """The configuration: training hyper-parameters and the compared runs (``runs``, a list of dicts)."""
    config = ml_collections.ConfigDict()
    config.dataset = "cifar10"
    config.model = "resnet20"
    config.train_size = 50_000
    config.epochs = 160
    config.batch_size = 128  # global, split over the workers
    config.lr = 0.1
    config.momentum = 0.9
    config.weight_decay = 1e-4
    config.augment = True  # random_crop_flip(pad=4) of experiments.cifar10
    config.warmup_steps = 0  # learning-rate warm-up
    config.lr_before_compressor = False  # as the authors' code: the optimizer applies the learning rate
    config.runs = [
        {"compressor": "identity"},  # dense baseline
        {"compressor": "topk", "ratio": 0.001},  # gradient dropping
        {"compressor": "dgc", "ratio": 0.001, "sparsity_warmup_epochs": 4, "sample_ratio": 0.01},
    ]
    return config
