"""experiments.cpu_devices: the simulated CPU devices of the scripts, with a thread pool that cannot deadlock."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.cpu_devices import force_cpu_devices

ROOT = Path(__file__).resolve().parents[1]


def test_a_fresh_process_gets_the_devices_and_twice_as_many_pool_threads():
    code = ("from experiments.cpu_devices import force_cpu_devices\n"
            "print(force_cpu_devices(3), force_cpu_devices(5))\n"
            "import os, jax\n"
            "print(jax.device_count(), os.environ['PJRT_NPROC'], os.environ['XLA_FLAGS'])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split("\n")
    assert out[0] == "True False"  # the second call: the device count is already given
    count, nproc, flags = out[1].split(" ", 2)
    assert (count, nproc) == ("3", "6")
    assert "--xla_cpu_enable_concurrency_optimized_scheduler=false" in flags


def test_after_jax_started_nothing_is_changed():
    code = ("import os, jax\n"
            "from experiments.cpu_devices import force_cpu_devices\n"
            "print(force_cpu_devices(3), os.environ.get('XLA_FLAGS'), os.environ.get('PJRT_NPROC'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["False", "None", "None"]


def test_a_bad_count_names_the_parameter():
    for n in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="n must be an integer >= 1"):
            force_cpu_devices(n)
