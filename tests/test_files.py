"""Owner-only files stay owner-only, even when a file (or a link) of that name already exists."""

import os
import stat

import pytest

from dpscale.files import open_for_writing, write_atomic, write_json_atomic


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("append", [False, True])
def test_a_reader_of_an_old_world_readable_file_never_sees_the_secret(tmp_path, append):
    # chmod would not take back a descriptor opened while the file was 0644: the secret must
    # go into a new file, and the old one keeps only what it held.
    path = tmp_path / "diagnostics.NOT-PRIVATE.jsonl"
    path.write_text("old\n")
    os.chmod(path, 0o644)
    with open(path) as spy:
        with open_for_writing(str(path), private=True, append=append) as f:
            f.write("secret\n")
        assert "secret" not in spy.read()
    assert _mode(path) == 0o600
    assert path.read_text() == ("old\nsecret\n" if append else "secret\n")


def test_an_owner_only_file_is_appended_to_in_place(tmp_path):
    path = tmp_path / "diagnostics.NOT-PRIVATE.jsonl"
    with open_for_writing(str(path), private=True, append=True) as f:
        f.write("1\n")
    inode = os.stat(path).st_ino
    with open_for_writing(str(path), private=True, append=True) as f:
        f.write("2\n")
    assert os.stat(path).st_ino == inode and path.read_text() == "1\n2\n" and _mode(path) == 0o600


@pytest.mark.parametrize("append", [False, True])
def test_a_planted_symlink_is_not_followed(tmp_path, append):
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    os.chmod(target, 0o644)
    link = tmp_path / "seed.json"
    link.symlink_to(target)
    if append:
        with pytest.raises(OSError):  # O_NOFOLLOW: refuse rather than write through it
            open_for_writing(str(link), private=True, append=True)
    else:
        with open_for_writing(str(link), private=True) as f:
            f.write("secret")
        assert not link.is_symlink() and link.read_text() == "secret" and _mode(link) == 0o600
    assert target.read_text() == "untouched" and _mode(target) == 0o644


def test_an_atomic_write_uses_a_fresh_temporary_file(tmp_path):
    # A crash between writing a ``.tmp`` and the rename may leave one behind, world-readable,
    # maybe opened by someone: it must never receive the next secret.
    path = tmp_path / "seed.json"
    leftover = tmp_path / "seed.json.tmp"
    leftover.write_text("{}")
    os.chmod(leftover, 0o666)
    write_json_atomic(str(path), {"seed": 1}, private=True)
    assert _mode(path) == 0o600
    assert leftover.read_text() == "{}"
    assert path.read_text() == '{\n  "seed": 1\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seed.json", "seed.json.tmp"]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text("old")

    def fail(f):
        f.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic(str(path), fail)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["ledger.json"]


def test_public_files_keep_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        write_atomic(str(tmp_path / "ledger.json"), lambda f: f.write("{}"))
        with open_for_writing(str(tmp_path / "metrics.jsonl"), private=False, append=True) as f:
            f.write("{}\n")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "ledger.json") == 0o600  # the user's umask wins for public files
    assert _mode(tmp_path / "metrics.jsonl") == 0o600


def test_binary_private_file(tmp_path):
    path = tmp_path / "plot.NOT-PRIVATE.png"
    with open_for_writing(str(path), private=True, binary=True) as f:
        f.write(b"\x89PNG")
    assert _mode(path) == 0o600 and path.read_bytes() == b"\x89PNG"


def test_a_runs_seed_and_diagnostics_are_owner_only_even_over_old_files(tmp_path):
    from dpscale.training.release import DIAGNOSTICS_FILE
    from dpscale.training.run_directory import SEED_FILE, RunDirectory, RunSecrets

    run = RunDirectory(str(tmp_path))
    seed_file = run.secrets_file  # in the key store, never in the run directory
    assert os.path.dirname(seed_file) != str(tmp_path) and os.path.basename(seed_file).endswith(SEED_FILE)
    for name in (seed_file, tmp_path / DIAGNOSTICS_FILE):
        with open(name, "w"):
            pass
        os.chmod(name, 0o644)
    with open(seed_file) as spy:
        run.write_secrets(RunSecrets(seed=12345, data_identity="x"))
        assert "12345" not in spy.read()
    run.append_metrics({"step": 1, "loss": 0.5}, diagnostic=True)
    run.truncate_metrics(after_step=1)
    assert _mode(seed_file) == 0o600
    assert _mode(tmp_path / DIAGNOSTICS_FILE) == 0o600
    assert run.read_secrets().seed == 12345
    assert not any("12345" in p.read_text() for p in tmp_path.iterdir() if p.is_file())


def test_owner_only_files_hold_for_nested_and_concurrent_writers_and_give_the_umask_back(tmp_path):
    import threading

    from dpscale.files import owner_only_files

    old = os.umask(0o022)
    try:
        inside, release = threading.Barrier(3), threading.Event()

        def writer(name):
            with owner_only_files():
                inside.wait()
                release.wait()  # both threads hold it; the first to leave must not give 022 back to the other
                with owner_only_files():  # nested
                    (tmp_path / name).write_text("x")
                (tmp_path / f"{name}-after").write_text("x")

        threads = [threading.Thread(target=writer, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        inside.wait()
        release.set()
        for t in threads:
            t.join()
        assert os.umask(0o022) == 0o022  # the caller's umask is back
    finally:
        os.umask(old)
    assert {p.name: _mode(p) for p in tmp_path.iterdir()} == dict.fromkeys(["a", "b", "a-after", "b-after"], 0o600)


def test_an_owner_only_directory_is_closed_even_if_it_existed(tmp_path):
    from dpscale.files import makedirs_owner_only

    (tmp_path / "old").mkdir(mode=0o755)
    makedirs_owner_only(str(tmp_path / "old"))
    makedirs_owner_only(str(tmp_path / "new" / "entry"))
    assert _mode(tmp_path / "old") == _mode(tmp_path / "new" / "entry") == 0o700
