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

    python -m experiments.reproduce.dgc --config experiments/configs/dgc_cifar10_resnet20.py

References:
  Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression: Reducing the
  Communication Bandwidth for Distributed Training", ICLR 2018.  Aji &
  Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017
  (gradient dropping).  He, Zhang, Ren & Sun, "Deep Residual Learning for Image
  Recognition", CVPR 2016.
"""

from __future__ import annotations

import ml_collections

from experiments.configs import main_job


def get_config() -> ml_collections.ConfigDict:
    """The shared main-job settings (``train``) and the compared runs (``runs``: name, compressor options)."""
    config = ml_collections.ConfigDict()
    config.train = main_job.get_config()  # every key can be overridden: --config.train.epochs=1
    config.train.update(dataset="cifar10", model="resnet20", epochs=160, batch_size=128, lr=0.1, momentum=0.9,
                        weight_decay=1e-4, warmup_steps=0)
    config.train.augment = True  # random_crop_flip(pad=4) of experiments.cifar10
    config.train.lr_before_compressor = False  # as the authors' code: the optimizer applies the learning rate
    config.seeds = (0,)
    config.runs = [
        {"name": "baseline", "compressor": {"name": "identity"}},  # dense
        {"name": "gradient dropping", "compressor": {"name": "topk", "ratio": 0.001}},
        {"name": "DGC", "compressor": {"name": "dgc", "ratio": 0.001, "sample_ratio": 0.01},
         "sparsity_warmup_epochs": 4},
    ]
    return config
