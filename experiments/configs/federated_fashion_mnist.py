"""Federated learning with compressed uplinks on Fashion-MNIST (Huang, Li & Li, ICLR 2024, in shape).

200 clients holding 2 classes each, 10% participation, 10 local SGD steps of
batch 32 per round, multinomial logistic regression, 300 rounds, two seeds;
the rows compare full-precision FedAvg and SCAFFOLD with compressed FedAvg,
SCALLION and SCAFCOM.  Runs on CPU in about 2.5 minutes:

    python -m experiments.reproduce.federated --config experiments/configs/federated_fashion_mnist.py
    python -m experiments.reproduce.federated --config.rounds=20 --config.seeds=0   # a quick look

Every key can be overridden with ``--config.KEY=VALUE`` (tuples as
``--config.seeds=0,1``); the rows (``rows``: a tuple of dicts) are changed by a
config file of your own that starts from this one.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
    """The setup (clients, participation, local steps), the optimisation settings and the compared rows."""
    config = ml_collections.ConfigDict()
    config.num_clients = 200
    config.classes_per_client = 2  # with split = "classes"
    config.participation = 0.1  # fraction of the clients sampled each round
    config.local_steps = 10  # K: local SGD steps per round
    config.batch_size = 32  # per local step
    config.hidden = 0  # 0: logistic regression (784 x 10 + 10); H > 0: a 784-H-10 MLP
    config.local_lr = 0.1
    config.global_lr = 1.0
    config.rounds = 300
    config.eval_every = 10  # rounds between test evaluations (and at the last round)
    config.seeds = (0, 1)  # each fixes the initialisation, the client sampling, the batches and the compressors' keys
    config.split = "classes"  # "classes" (classes_per_client each) or "dirichlet" (dirichlet_alpha)
    config.split_seed = 0  # the split is the same for every seed
    config.dirichlet_alpha = 0.1
    config.train_limit = config_dict.placeholder(int)  # use only the first N training images (None: all)
    config.target_fraction = 0.98  # "bytes to target": this fraction of classic SCAFFOLD's final accuracy
    # name -> algorithm and its options; "uplink" is None (float32 all-reduce), ("topk", ratio), ("randomk", ratio)
    # or ("qsgd", levels), never with error feedback.  SCALLION diverged with alpha >= 0.3 at random-5%
    # (omega = 19; the analysis asks for alpha about 1/(1+omega)), so alpha = 0.1; beta = 0.2 as in the paper's notes.
    config.rows = (
        {"name": "fedavg", "algorithm": "fedavg", "uplink": None},
        {"name": "scaffold", "algorithm": "scaffold", "uplink": None},
        {"name": "scaffold-1msg", "algorithm": "scaffold", "uplink": None, "single_message": True},
        {"name": "fedavg-top1%", "algorithm": "fedavg", "uplink": ("topk", 0.01)},
        {"name": "scallion-rand5%", "algorithm": "scallion", "uplink": ("randomk", 0.05), "alpha": 0.1},
        {"name": "scafcom-top1%", "algorithm": "scafcom", "uplink": ("topk", 0.01), "beta": 0.2},
    )
    return config
