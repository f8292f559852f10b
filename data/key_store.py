"""The per-user key store: where the secrets of caches, work directories and runs live.

A secret kept inside the directory it protects travels with every copy of it: a shared feature
cache would carry the key of its keyed data identities, which then become a plain test for
candidate data sets, and a copied unfinished run would carry its seed. So secrets live in one
directory per user, outside anything users share: ``$DPSCALE_KEY_STORE`` if set, else
``$XDG_CONFIG_HOME/dpscale/keys``, else ``~/.config/dpscale/keys`` (mode 0700, every file 0600).

A directory with a secret names it by a random *key id* in its ``key.id`` file. The id is not
secret and may be copied along: without this user's key store it unlocks nothing, and a copy
used by someone else gets a secret of its own (a cache is then recomputed, a run cannot resume).
A remote directory (``gs://...``) is named by its URL instead; one secret per cache or run, never
one for all. Hand-written: a few standard-library calls, and no keyring library stores files
per directory the way this needs.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets

from dpscale.errors import DataError

ENV = "DPSCALE_KEY_STORE"
ID_FILE = "key.id"
SECRET_BYTES = 32
_ID = re.compile(r"[0-9a-f]{32}")


def store_dir() -> str:
    """This user's key store, created owner-only (0700) on first use."""
    path = os.environ.get(ENV) or os.path.join(
        os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config"), "dpscale", "keys"
    )
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
    except OSError as exc:
        raise DataError(f"cannot use the key store {path!r} (set {ENV}): {exc}") from None
    return path


def _write_new(path: str, content: bytes) -> None:
    """``content`` into ``path`` (0600) unless it exists: written aside, then linked, so no reader sees half."""
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(content)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process made it first: use theirs
    finally:
        os.remove(tmp)


def key_id(directory: str, *, create: bool = True) -> str:
    """The key id of ``directory`` (its ``key.id``, made on first use; a remote one: its URL's digest)."""
    if "://" in directory:
        return hashlib.sha256(directory.rstrip("/").encode()).hexdigest()[:32]
    path = os.path.join(directory, ID_FILE)
    if not os.path.exists(path):
        if not create:
            raise DataError(f"{directory!r} has no {ID_FILE}: its secrets are unknown here")
        os.makedirs(directory, exist_ok=True)
        _write_new(path, secrets.token_hex(16).encode())
        os.chmod(path, 0o644)  # not a secret: it only names one in the owner's key store
    try:
        with open(path) as f:
            found = f.read().strip()
    except OSError as exc:
        raise DataError(f"cannot read {path!r}: {exc}") from None
    if not _ID.fullmatch(found):
        raise DataError(f"{path!r} is not a key id; delete it (and what it keyed)")
    return found


def secret_path(ident: str, suffix: str) -> str:
    return os.path.join(store_dir(), f"{ident}.{suffix}")


def directory_secret(directory: str) -> bytes:
    """The 32-byte secret of ``directory`` (a feature cache, a work directory), made on first use."""
    path = secret_path(key_id(directory), "secret")
    if not os.path.exists(path):
        _write_new(path, secrets.token_bytes(SECRET_BYTES))
    return _read_secret(path)


def existing_secret(ident: str) -> bytes | None:
    """The secret of the directory whose key id is ``ident``, if this user's key store holds it (never made)."""
    path = secret_path(ident, "secret")
    return _read_secret(path) if os.path.exists(path) else None


def _read_secret(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            secret = f.read()
    except OSError as exc:
        raise DataError(f"cannot read the secret {path!r}: {exc}") from None
    if len(secret) != SECRET_BYTES:
        raise DataError(f"{path!r} is not a {SECRET_BYTES}-byte secret; delete it (and the cache entries it keyed)")
    return secret
