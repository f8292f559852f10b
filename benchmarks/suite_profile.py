"""A pytest plugin that records every test's wall time and peak memory, to find the suite's heaviest tests.

    PYTHONPATH=benchmarks DPSCALE_SUITE_PROFILE=/tmp/profile python -m pytest -p suite_profile -n 2 -q

Each process that runs tests (each xdist worker) appends one JSON line per test to
``$DPSCALE_SUITE_PROFILE.<worker>.jsonl``: the test's id, its seconds (set-up, call and
tear-down), the worker's resident memory before and after it, and its peak while the test ran
(sampled every 0.1 s; processes the test starts are not in it). xdist's controller samples the
whole tree (its workers and every process they start: CLI subprocesses, Beam's workers) once a
second into ``$DPSCALE_SUITE_PROFILE.main.trace.json``: the suite's memory. (A first version walked
the tree from each worker every 50 ms; that CPU kept a local Beam pipeline's stall watchdog from ever
seeing the test idle, and a test that waits for it hung.) ``python benchmarks/suite_profile.py PREFIX``
prints the heaviest tests, by peak and by time, and each trace's peak. Without the variable the plugin
does nothing. Results: benchmarks/results/test_suite.md.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import threading
import time
from typing import Any

import pytest

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss(pid: int) -> int:
    """Resident bytes of ``pid`` (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (children files need no extra package)."""
    found, stack = [], [pid]
    while stack:
        parent = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found.extend(kids)
            stack.extend(kids)
    return found


class _Sampler(threading.Thread):
    """Samples resident memory every ``interval`` s: of this process only (``tree=False``: cheap enough not to
    count as work for the local Beam runner's stall watchdog, which watches the test process's CPU), or of
    this process and its descendants. ``peak`` since the last ``reset``; ``trace`` for the whole session."""

    def __init__(self, *, tree: bool, interval: float) -> None:
        super().__init__(daemon=True)
        self.tree, self.interval = tree, interval
        self.peak, self.trace = 0, []
        self._lock = threading.Lock()

    def run(self) -> None:
        me = os.getpid()
        last = 0.0
        while True:
            total = _rss(me) + (sum(_rss(p) for p in _descendants(me)) if self.tree else 0)
            with self._lock:
                self.peak = max(self.peak, total)
            if time.time() - last >= 1.0:
                self.trace.append((round(time.time(), 1), total))
                last = time.time()
            time.sleep(self.interval)

    def reset(self) -> int:
        with self._lock:
            peak, self.peak = self.peak, 0
        return peak


_sampler: _Sampler | None = None


def _out(config: Any) -> str | None:
    prefix = os.environ.get("DPSCALE_SUITE_PROFILE")
    if not prefix:
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    return f"{prefix}.{worker}.jsonl"


def pytest_configure(config: Any) -> None:
    global _sampler
    if _out(config) is None or _sampler is not None:
        return
    controller = not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))
    # xdist's controller runs no test: it watches the whole tree (its workers and everything they start)
    _sampler = _Sampler(tree=True, interval=1.0) if controller else _Sampler(tree=False, interval=0.1)
    _sampler.start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Any:
    path = _out(item.config)
    if path is None or _sampler is None:
        yield
        return
    before = _rss(os.getpid())
    _sampler.reset()
    start = time.time()
    yield
    row = {
        "test": item.nodeid,
        "seconds": round(time.time() - start, 2),
        "start": round(start, 1),
        "rss_before_mb": before >> 20,
        "rss_after_mb": _rss(os.getpid()) >> 20,
        "peak_mb": max(_sampler.reset(), before) >> 20,
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_unconfigure(config: Any) -> None:
    path = _out(config)
    if path is not None and _sampler is not None:
        with open(path.replace(".jsonl", ".trace.json"), "w") as f:
            json.dump(_sampler.trace, f)


def summary(prefix: str, *, top: int = 30) -> None:
    rows = [json.loads(line) for path in sorted(glob.glob(f"{prefix}.*.jsonl")) for line in open(path)]
    print(f"{len(rows)} tests, {sum(r['seconds'] for r in rows) / 60:.1f} test-minutes")
    for key in ("peak_mb", "seconds"):
        print(f"\nheaviest by {key}:")
        for row in sorted(rows, key=lambda r: -r[key])[:top]:
            print(f"  {row['peak_mb']:>8} MB peak  {row['seconds']:>7} s  {row['test']}")
    for path in sorted(glob.glob(f"{prefix}.*.trace.json")):  # "main": the whole tree (xdist's workers too)
        trace = json.load(open(path))
        if trace:
            print(f"\n{path}: peak {max(r for _, r in trace) >> 20} MB over {trace[-1][0] - trace[0][0]:.0f} s")


if __name__ == "__main__":
    summary(sys.argv[1])
