"""Framework-neutral timing for the peers benchmark: one measurement per fresh subprocess.

Every framework's worker builds a ``step()`` that runs one *logical* batch (all its
micro-batches, the noise and the update) and blocks until done, then hands it to
:func:`measure`, which prints one JSON line. Wall time is what a user sees; process CPU
time (all threads) is reported too because it is much steadier when other jobs share the
cores. Peak memory is the process's max RSS, which includes the framework runtime itself
(``rss_base_mb`` is the RSS before the model and data were built).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from collections.abc import Callable


def rss_now_mb() -> float:
    """Current resident set size (Linux /proc), in MB."""
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(
    step: Callable[[], None], *, examples: int, warmup: int, repeats: int, rss_base_mb: float, extra: dict | None = None
) -> dict:
    """Median wall and CPU seconds of ``step`` over ``repeats`` calls after ``warmup`` calls."""
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    warmup_s = time.perf_counter() - start
    walls, cpus = [], []
    for _ in range(repeats):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall0)
        cpus.append(time.process_time() - cpu0)
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    return {
        "status": "ok",
        "examples_per_s": examples / wall,
        "cpu_ms_per_example": 1e3 * cpu / examples,
        "wall_s": walls,
        "cpu_s": cpus,
        "warmup_s": warmup_s,
        "peak_rss_mb": peak_rss_mb(),
        "rss_base_mb": rss_base_mb,
        "load1": os.getloadavg()[0],
        **(extra or {}),
    }


def emit(result: dict) -> None:
    """The one line the parent process parses."""
    print("PEERS-RESULT " + json.dumps(result), flush=True)


def parse_runner_args(frameworks: tuple[str, ...]) -> argparse.Namespace:
    """The command line every per-framework runner subprocess takes (set by ``peers.py``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=frameworks, required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--physical", type=int, required=True)
    parser.add_argument("--logical", type=int, required=True)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--clip-tuning",
        default=None,
        help="dpscale: clip with these device settings (a backend's: cpu, gpu, ...; or gpu-timed: explicit "
        "against grouped per-example gradients timed per layer; default: the running backend's)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="torch runners: where the step runs (auto: CUDA when present)",
    )
    return parser.parse_args()
