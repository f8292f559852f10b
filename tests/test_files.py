"""Owner-only files stay owner-only, even when a file of that name already exists."""

import os
import stat

import pytest
from dpscale.files import open_for_writing, write_atomic, write_json_atomic


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("append", [False, True])
def test_a_private_file_that_existed_world_readable_becomes_owner_only(tmp_path, append):
    path = tmp_path / "diagnostics.NOT-PRIVATE.jsonl"
    path.write_text("old\n")
    os.chmod(path, 0o644)
    with open_for_writing(str(path), private=True, append=append) as f:
        f.write("new\n")
    assert _mode(path) == 0o600
    assert path.read_text() == ("old\nnew\n" if append else "new\n")


def test_an_atomic_write_does_not_inherit_a_leftover_tmp_files_mode(tmp_path):
    # A crash between writing ``x.tmp`` and the rename leaves it behind, maybe world-readable.
    path = tmp_path / "seed.json"
    leftover = tmp_path / "seed.json.tmp"
    leftover.write_text("{}")
    os.chmod(leftover, 0o666)
    write_json_atomic(str(path), {"seed": 1}, private=True)
    assert _mode(path) == 0o600
    assert not leftover.exists()
    assert path.read_text() == '{\n  "seed": 1\n}\n'


def test_public_files_keep_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        write_atomic(str(tmp_path / "ledger.json"), lambda f: f.write("{}"))
    finally:
        os.umask(old)
    assert _mode(tmp_path / "ledger.json") == 0o600  # the user's umask wins for public files


def test_binary_private_file(tmp_path):
    path = tmp_path / "plot.NOT-PRIVATE.png"
    with open_for_writing(str(path), private=True, binary=True) as f:
        f.write(b"\x89PNG")
    assert _mode(path) == 0o600 and path.read_bytes() == b"\x89PNG"


def test_a_runs_seed_and_diagnostics_are_owner_only_even_over_old_files(tmp_path):
    from dpscale.training.release import DIAGNOSTICS_FILE
    from dpscale.training.run_directory import SEED_FILE, RunDirectory, RunSecrets

    run = RunDirectory(str(tmp_path))
    for name in (SEED_FILE + ".tmp", DIAGNOSTICS_FILE):
        (tmp_path / name).write_text("")
        os.chmod(tmp_path / name, 0o644)
    run.write_secrets(RunSecrets(seed=12345, data_identity="x"))
    run.append_metrics({"step": 1, "loss": 0.5}, diagnostic=True)
    run.truncate_metrics(after_step=1)
    assert _mode(tmp_path / SEED_FILE) == 0o600
    assert _mode(tmp_path / DIAGNOSTICS_FILE) == 0o600
