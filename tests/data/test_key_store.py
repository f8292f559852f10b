"""Secrets live in the user's key store: a copied cache or run directory carries no key."""

import hashlib
import json
import os
import shutil
import stat

import pytest

from dpscale.data import key_store
from dpscale.data.identity import keyed_identity
from dpscale.errors import DataError


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def store(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    monkeypatch.setenv(key_store.ENV, str(path))
    return path


def test_secrets_are_owner_only_in_the_store_and_absent_from_the_directory(store, tmp_path):
    cache = tmp_path / "cache"
    secret = key_store.directory_secret(str(cache))
    assert len(secret) == 32 and key_store.directory_secret(str(cache)) == secret  # stable
    assert _mode(store) == 0o700
    assert [_mode(p) for p in store.iterdir()] == [0o600]
    assert sorted(p.name for p in cache.iterdir()) == [key_store.ID_FILE]
    assert secret not in (cache / key_store.ID_FILE).read_bytes() and secret.hex() not in (cache / "key.id").read_text()


def test_one_secret_per_directory(store, tmp_path):
    assert key_store.directory_secret(str(tmp_path / "a")) != key_store.directory_secret(str(tmp_path / "b"))
    remote = [key_store.directory_secret(url) for url in ("gs://bucket/one", "gs://bucket/two", "gs://bucket/one/")]
    assert remote[0] != remote[1] and remote[0] == remote[2]  # one secret per remote cache, not one for all


def test_a_moved_directory_keeps_its_secret_for_its_owner(store, tmp_path):
    key_store.directory_secret(str(tmp_path / "a"))
    before = key_store.directory_secret(str(tmp_path / "a"))
    shutil.move(tmp_path / "a", tmp_path / "b")
    assert key_store.directory_secret(str(tmp_path / "b")) == before


def test_a_copied_directory_without_the_key_store_tests_nothing(store, tmp_path, monkeypatch):
    """The review's reproducer: with a shared cache's key, its HMAC was a plain test of candidate data sets."""
    cache = tmp_path / "cache"
    data, neighbour = "content-hash-of-D", "content-hash-of-D-minus-x"
    published = keyed_identity(key_store.directory_secret(str(cache)), data)
    copied = tmp_path / "copied"
    shutil.copytree(cache, copied)
    monkeypatch.setenv(key_store.ENV, str(tmp_path / "someone-else"))
    other = key_store.directory_secret(str(copied))  # whoever holds the copy gets a secret of their own
    assert keyed_identity(other, data) != published and keyed_identity(other, neighbour) != published
    assert hashlib.sha256(data.encode()).hexdigest() != published


def test_a_damaged_key_id_or_secret_is_one_line(store, tmp_path):
    cache = tmp_path / "cache"
    key_store.directory_secret(str(cache))
    (store / f"{(cache / 'key.id').read_text()}.secret").write_bytes(b"short")
    with pytest.raises(DataError, match="32-byte"):
        key_store.directory_secret(str(cache))
    (cache / "key.id").write_text("../../etc/passwd")
    with pytest.raises(DataError, match="not a key id"):
        key_store.directory_secret(str(cache))


def test_a_copied_unfinished_run_carries_no_seed_and_cannot_resume(store, tmp_path, monkeypatch):
    from dpscale.training.run_directory import RunDirectory, RunSecrets

    run = RunDirectory(str(tmp_path / "run"))
    os.makedirs(run.path)
    run.write_secrets(RunSecrets(seed=2**62 + 99, data_identity="x"))
    assert run.read_secrets().seed == 2**62 + 99
    assert not any(str(2**62 + 99) in p.read_text() for p in (tmp_path / "run").iterdir())
    copied = tmp_path / "copied"
    shutil.copytree(run.path, copied)
    (copied / "config.json").write_text(json.dumps({}))
    monkeypatch.setenv(key_store.ENV, str(tmp_path / "someone-else"))
    with pytest.raises(DataError, match="key store"):
        RunDirectory(str(copied)).read_secrets()
