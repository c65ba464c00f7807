"""The DGC reproduction script: configs become main-job arguments; a tiny run writes the table and the plot."""

import json

from experiments import train
from experiments.reproduce import dgc


def test_configs_become_main_job_arguments():
    cfg = dgc.load_config("cifar10_resnet20")
    argv = dgc.train_args(cfg)
    args = train.parse_args(argv + ["--compressor", "dgc"])  # every argument is one the main job knows
    assert (args.dataset, args.model, args.epochs, args.batch_size, args.augment) == ("cifar10", "resnet20", 160, 128, True)
    runs = dgc.runs(cfg)
    assert list(runs) == ["baseline", "gradient dropping", "DGC"]
    dgc_args = train.parse_args(argv + runs["DGC"])
    assert dgc_args.sparsity_warmup_steps == 4 * (50_000 // 128) and dgc_args.ratio == 0.001
    assert train.parse_args(argv + runs["gradient dropping"]).compressor == "topk"


def test_tiny_reproduction_writes_table_and_plot(tmp_path):
    tiny = "--epochs 1 --max-steps 2 --train-limit 512 --batch-size 64"
    out = dgc.main(["--out-dir", str(tmp_path), "--train-args", tiny])
    assert set(out) == {"baseline", "gradient dropping", "DGC"}
    md = (tmp_path / "dgc_fashion_mnist_cnn.md").read_text()
    assert md.count("\n| ") == 4 and "ratio at final sparsity" in md  # header + 3 runs
    assert (tmp_path / "dgc_fashion_mnist_cnn.png").stat().st_size > 1000
    rec = [json.loads(x) for x in (tmp_path / "dgc" / "fashion_mnist_cnn" / "dgc.jsonl").read_text().splitlines()]
    assert rec[-1]["config"]["options"]["sparsity_warmup_steps"] == 234  # 1 epoch of 60000 // 256 steps
    # Report-only rebuilds the same table from the records without training.
    dgc.main(["--out-dir", str(tmp_path), "--report-only"])
    assert (tmp_path / "dgc_fashion_mnist_cnn.md").read_text().split("\n", 1)[1] == md.split("\n", 1)[1]
