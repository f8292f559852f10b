"""Ctrl-C at any moment of a real ``dpscale`` process: one line, exit code 130 within seconds, never a
traceback or a crash; a run stopped anywhere continues with ``--resume`` (cli_output.end_promptly_on_interrupt).

Each phase is recognised from outside, not guessed from a delay: jax's library mapped into the
process (importing), the run's files written but no step logged (calibrating and compiling the first
step), a step logged, an orbax checkpoint being written (its temporary directory), Beam's worker
processes started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from dpscale.stages import ingest

INTERRUPTED = 130
STEPS = 12
PROMPT = 10.0  # seconds from the signal to the exit: "a few", with room for a loaded 2-core machine


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("data") / "digits")
    ingest.run(ingest.IngestConfig(source="digits", output_dir=out))
    return out


def _start(*args: str, cache: Path | None = None) -> subprocess.Popen:
    """``dpscale ARGS`` as its own process; with ``cache``, its compilations shared through that directory."""
    env = dict(os.environ)
    if cache is not None:
        env |= {"JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "dpscale", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _interrupt_when(
    process: subprocess.Popen, ready: Callable[[], bool], *, poll: float = 0.005, limit: float = 300.0
) -> tuple[str, float, set[int]]:
    """SIGINT once ``ready()``; (stderr, seconds from the signal to the exit, pids of its children then)."""
    deadline = time.monotonic() + limit
    while not ready():
        assert process.poll() is None, f"it ended before the moment came: {process.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "the moment never came"
        time.sleep(poll)
    children = {p.pid for p in psutil.Process(process.pid).children(recursive=True)}
    process.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    try:
        _, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
    return err, time.monotonic() - signalled, children


def _one_line(process: subprocess.Popen, err: str, seconds: float, *, resume: str | None) -> None:
    assert process.returncode == INTERRUPTED, (process.returncode, err[-3000:])
    assert seconds < PROMPT, f"it took {seconds:.1f} s to end"
    assert "Traceback" not in err and "Segmentation" not in err and "aborted" not in err, err[-3000:]
    said = [line for line in err.splitlines() if "interrupted" in line]
    want = "dpscale: interrupted" + (f"; continue the run with `dpscale train --resume {resume}`" if resume else "")
    assert said == [want] and err.rstrip().endswith(want), err[-3000:]


def _maps(process: subprocess.Popen, name: str) -> bool:
    try:
        return name in Path(f"/proc/{process.pid}/maps").read_text()
    except OSError:
        return False


def _metrics_lines(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _saves_under_way(run: Path) -> set[str]:
    """orbax's temporary directories of checkpoints being written (or left by a save cut short)."""
    folder = run / "checkpoints"
    return {p.name for p in folder.iterdir() if "tmp" in p.name} if folder.is_dir() else set()


def test_ctrl_c_while_importing_is_one_line_and_leaves_nothing_to_resume(digits, tmp_path):
    run = tmp_path / "run"
    process = _start("train", digits, str(run), "--steps", "2", "--batch-size", "32")
    err, seconds, _ = _interrupt_when(process, lambda: _maps(process, "jaxlib"), poll=0.001)
    _one_line(process, err, seconds, resume=None)
    assert not (run / "config.json").exists()


def test_ctrl_c_while_compiling_after_a_step_and_in_a_checkpoint_then_resume_finishes_the_run(digits, tmp_path):
    run, cache = tmp_path / "run", tmp_path / "jax-cache"  # the first compilation is a real one
    process = _start(
        "train",
        digits,
        str(run),
        "--model",
        "cnn-small",
        "--steps",
        str(STEPS),
        "--batch-size",
        "32",
        "--microbatch-size",
        "32",
        "--checkpoint-every",
        "1",
        "--accountant",
        "rdp",
        cache=cache,
    )
    compiling = lambda: (run / "ledger.json").exists() and not (run / "metrics.jsonl").exists()  # noqa: E731
    err, seconds, _ = _interrupt_when(process, compiling, poll=0.001)
    _one_line(process, err, seconds, resume=str(run))

    process = _start("train", "--resume", str(run), cache=cache)
    logged = _metrics_lines(run)
    err, seconds, _ = _interrupt_when(process, lambda: _metrics_lines(run) > logged)
    _one_line(process, err, seconds, resume=str(run))

    left = _saves_under_way(run)  # the last save may have been cut short: not the moment we wait for
    process = _start("train", "--resume", str(run), cache=cache)
    err, seconds, _ = _interrupt_when(process, lambda: bool(_saves_under_way(run) - left), poll=0.001)
    _one_line(process, err, seconds, resume=str(run))

    out, err = _start("train", "--resume", str(run), cache=cache).communicate(timeout=600)
    assert json.loads(out)["steps"] == STEPS, err[-3000:]
    assert not _saves_under_way(run)  # what the interrupted saves left was cleared
    assert json.loads((run / "ledger.json").read_text())["steps_done"] == STEPS
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, STEPS + 1))  # every step exactly once


def test_ctrl_c_during_a_beam_pipeline_stops_its_worker_processes_too(tmp_path):
    process = _start(
        "ingest",
        "digits",
        str(tmp_path / "out"),
        "--",
        "--direct_num_workers=2",
        "--direct_running_mode=multi_processing",
    )
    workers = lambda: len(psutil.Process(process.pid).children(recursive=True)) >= 2  # noqa: E731
    err, seconds, children = _interrupt_when(process, workers, poll=0.01)
    _one_line(process, err, seconds, resume=None)
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in children if psutil.pid_exists(pid)], timeout=5)
    assert not alive, f"worker processes left running: {alive}"


# A thread that keeps printing progress lines (the main thread of a run prints them) until the process ends.
PRINTING_WHEN_INTERRUPTED = """
import sys, threading, time
from dpscale import cli_output

def progress():
    while True:
        print("train: 0/12, compiling the DP step ...", file=sys.stderr, flush=True)
        time.sleep(0.0002)

threading.Thread(target=progress, daemon=True).start()
time.sleep(0.05)
cli_output._end()
"""


def test_the_interrupted_line_is_the_last_even_while_another_thread_prints():
    """The race seen under load: a progress line printed between the interrupted line and the exit."""
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", PRINTING_WHEN_INTERRUPTED], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == INTERRUPTED, done.stderr[-2000:]
        assert done.stderr.rstrip().splitlines()[-1] == "dpscale: interrupted", done.stderr[-500:]
