"""One process trains in a run directory at a time; a lock whose holder died never blocks a resume."""

import os
import subprocess
import sys
import time

import pytest

from dpscale.errors import DataError
from dpscale.training.run_lock import RunLock, _process_alive


def test_a_held_lock_refuses_a_second_holder_naming_the_first_and_frees_on_release(tmp_path):
    path = str(tmp_path / "run.lock")
    with RunLock(path):
        with pytest.raises(DataError, match=f"is in use: another process \\(pid {os.getpid()}\\)"):
            RunLock(path)
    with RunLock(path):  # released: free again, though the file stays
        pass
    assert os.path.exists(path)


def test_a_lock_whose_holder_was_killed_is_free(tmp_path):
    path = str(tmp_path / "run.lock")
    code = (
        "import os, sys\nfrom dpscale.training.run_lock import RunLock\n"
        f"lock = RunLock({path!r})\nprint('held', flush=True)\nos.kill(os.getpid(), 9)\n"
    )
    held = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert held.stdout == "held\n" and held.returncode == -9
    RunLock(path).release()


def test_a_killed_process_not_yet_reaped_counts_as_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert _process_alive(os.getpid())
        for _ in range(1000):  # until it has exited but is not yet waited for: a zombie
            with open(f"/proc/{child.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        assert not _process_alive(child.pid)
    finally:
        child.wait()
    assert not _process_alive(child.pid) and not _process_alive(0)
