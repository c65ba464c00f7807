"""Root test setup, loaded by pytest before it imports any test module or the package's doctests.

The simulated devices must be requested before JAX starts its backend: 8 CPU
devices, so multi-worker code (tests and the docstring examples of
``compjax``, run with ``--doctest-modules``) runs without a GPU.

XLA:CPU (jaxlib 0.10.2) has crashed (SIGSEGV in its in-process all-reduce) on
programs that hold many conditionals with collectives inside, such as the
battery's programs with several wrapped compressors side by side; with its
concurrency-optimized scheduler off it did not, so the tests turn it off.

The tests' programs are small and compiled once or run a few steps: most of a
test's time is XLA compiling.  Two flags make XLA:CPU compile faster and run a
little slower, without fast math: LLVM without its optimization passes, and the
elemental emitters instead of the newer fusion emitters.  On this project's
tests (jaxlib 0.10.2, 2 cores) they cut a run's time by half.  What a program
computes stays the same up to rounding where XLA computes one expression twice,
but the fusions, and so the memory of a program, differ: the tests that measure
memory or promise bits between two compiled programs compile with XLA's defaults
(``tests.helpers.USERS_CODEGEN``, the ``users_codegen`` marker of
tests/conftest.py).  Every process a test starts inherits the flags
(``XLA_FLAGS``); programs run outside the tests (users', the benchmarks') do not
get them.
"""

import os

NUM_DEVICES = 8
CPU_FLAGS = {
    "--xla_force_host_platform_device_count": str(NUM_DEVICES),
    "--xla_cpu_enable_concurrency_optimized_scheduler": "false",
}
#: XLA:CPU compiling fast (see above); left out in a process started with ``COMPJAX_TEST_CODEGEN=users``
FAST_COMPILE_FLAGS = {
    "--xla_backend_optimization_level": "0",
    "--xla_cpu_use_fusion_emitters": "false",
}
if os.environ.get("COMPJAX_TEST_CODEGEN") != "users":
    CPU_FLAGS.update(FAST_COMPILE_FLAGS)


def force_cpu_devices(flags: dict = CPU_FLAGS) -> None:
    """Set ``flags`` in ``XLA_FLAGS`` (keeping the others) and the CPU platform; effective before JAX's backend starts."""
    ours = {*flags, *FAST_COMPILE_FLAGS}  # the fast-compile flags of a parent test process are not kept
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in ours]
    os.environ["XLA_FLAGS"] = " ".join([*kept, *(f"{k}={v}" for k, v in flags.items())])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


force_cpu_devices()
