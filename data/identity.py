"""Identifying a dataset without publishing a hash of it.

An ingested dataset's content hash (``data.manifest``) identifies its records exactly. Published
beside a DP result it would answer membership questions outright: whoever knows every record but
one can hash the two candidate data sets and compare. So anything that may leave the machine
(a ledger, a feature-cache key and the entry path derived from it, a backbone's metadata)
carries at most a *keyed* hash, HMAC-SHA256 under a secret that stays on the machine: it still
tells two data sets apart for whoever holds the secret (stale caches, a resume on changed data),
and nothing to anyone else. Hand-written because it is two calls to the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from dpscale.errors import DataError

SECRET_FILE = "identity.secret"  # beside a feature cache; 32 random bytes, mode 0600


def keyed_identity(secret: bytes, content: str) -> str:
    """HMAC-SHA256 of ``content`` (e.g. a content hash) under ``secret``, as hex."""
    return hmac.new(secret, content.encode("utf-8"), hashlib.sha256).hexdigest()


def seed_secret(seed: int) -> bytes:
    """A run's own secret: its seed (which never leaves the run directory's 0600 file)."""
    return seed.to_bytes(8, "big")


def directory_secret(directory: str) -> bytes:
    """The secret of ``directory`` (a feature cache), created on first use with mode 0600.

    A cache on a remote file system (``gs://...``) keeps its secret on this machine instead (the
    secret is only needed where the cache key is computed), one per cache: under
    ``~/.cache/dpscale/remote/``, named by a hash of the cache's URL.
    """
    if "://" in directory:
        url = hashlib.sha256(directory.rstrip("/").encode("utf-8")).hexdigest()[:32]
        directory = os.path.join(os.path.expanduser("~"), ".cache", "dpscale", "remote", url)
    path = os.path.join(directory, SECRET_FILE)
    os.makedirs(directory, exist_ok=True)
    if not os.path.exists(path):  # write aside, then link: two processes never see half a secret
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
        finally:
            os.remove(tmp)
    try:
        with open(path, "rb") as f:
            secret = f.read()
    except OSError as exc:
        raise DataError(f"cannot read the cache's secret {path!r}: {exc}") from None
    if len(secret) != 32:
        raise DataError(f"{path!r} is not a 32-byte secret; delete it (and the cache entries it keyed)")
    return secret
