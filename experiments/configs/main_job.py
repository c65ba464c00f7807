"""The main job's configuration: Fashion-MNIST CNN, 8 workers, SGD with momentum, one compressor.

    python -m experiments.train --config experiments/configs/main_job.py --config.compressor.name=topk \
        --config.compressor.ratio=0.01

Every key can be overridden on the command line with ``--config.KEY=VALUE``
(``--config.compressor.KEY=VALUE`` for the compressor's options); the main
job's short flags (``--compressor topk --ratio 0.01``) set the same keys.  A
config file of your own starts from this one::

    from experiments.configs import main_job

    def get_config():
        config = main_job.get_config()
        config.compressor.name = "powersgd"
        config.compressor.rank = 4
        return config
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from experiments import compressors


def get_config() -> ml_collections.ConfigDict:
    """The defaults of ``python -m experiments.train``."""
    c = ml_collections.ConfigDict()
    c.dataset = "fashion_mnist"  # or "cifar10" (with model "resnet20")
    c.model = "cnn"  # "cnn" takes 28x28x1 images, "resnet20" 32x32x3
    c.augment = False  # random crop (pad 4) and horizontal flip (CIFAR-10)
    c.epochs = 5
    c.max_steps = config_dict.placeholder(int)  # stop after this many steps (None: the whole run)
    c.train_limit = config_dict.placeholder(int)  # use only the first N training images (None: all)
    c.batch_size = 256  # global, split over the workers
    c.lr = 0.05  # peak learning rate: linear warm-up, then cosine decay to 0
    c.warmup_steps = 100
    c.momentum = 0.9  # of the SGD after the compressor (DGC applies it inside)
    c.weight_decay = 0.0  # L2, added to the gradients
    c.lr_before_compressor = False  # scale local gradients by the learning rate before the compressor
    c.seed = 0  # model initialization and data order
    c.workers = config_dict.placeholder(int)  # None: every device
    c.mesh = config_dict.placeholder(str)  # "SLOWxFAST": dense over the fast axis, compressed over the slow
    c.fsdp = False  # with a mesh: parameters and state sharded over the fast axis (parallel.fsdp_specs)
    c.skip_nonfinite = True  # every worker skips a step in which any worker's gradient is not finite
    c.poison_step = config_dict.placeholder(int)  # put a NaN into one worker's batch at this step (tests)
    c.poison_worker = config_dict.placeholder(int)  # that worker (default 0)
    c.skip_batch = config_dict.placeholder(int)  # drop this step's batch (the reference of a poisoned run)
    c.compressor = compressors.default_config()
    return c
