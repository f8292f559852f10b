"""The secrets that key a feature cache's data identity."""

import os
import stat

from dpscale.data.identity import SECRET_FILE, directory_secret, keyed_identity


def test_a_local_cache_keeps_its_own_secret_beside_it(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    secret = directory_secret(str(a))
    assert len(secret) == 32 and directory_secret(str(a)) == secret
    assert stat.S_IMODE(os.stat(a / SECRET_FILE).st_mode) == 0o600
    assert directory_secret(str(b)) != secret


def test_each_remote_cache_has_its_own_secret_on_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    first = directory_secret("gs://bucket/caches/one")
    assert directory_secret("gs://bucket/caches/one/") == first  # the same cache, however spelled
    second = directory_secret("gs://bucket/caches/two")
    assert second != first
    assert keyed_identity(first, "hash") != keyed_identity(second, "hash")
    secrets = sorted((tmp_path / "home" / ".cache" / "dpscale" / "remote").rglob(SECRET_FILE))
    assert len(secrets) == 2 and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in secrets)
    assert not (tmp_path / "home" / ".cache" / "dpscale" / SECRET_FILE).exists()  # no secret shared by all
