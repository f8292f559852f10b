"""Identifying a dataset without publishing a hash of it.

An ingested dataset's content hash (``data.manifest``) identifies its records exactly. Published
beside a DP result it would answer membership questions outright: whoever knows every record but
one can hash the two candidate data sets and compare. So anything that may leave the machine
(a ledger, a feature-cache key and the entry path derived from it, a backbone's metadata)
carries at most a *keyed* hash, HMAC-SHA256 under a secret kept in the user's key store
(``data.key_store``), never in the directory it protects: it still tells two data sets apart for
whoever holds the secret (stale caches, a resume on changed data), and nothing to anyone else.
Hand-written because it is two calls to the standard library.
"""

from __future__ import annotations

import hashlib
import hmac


def keyed_identity(secret: bytes, content: str) -> str:
    """HMAC-SHA256 of ``content`` (e.g. a content hash) under ``secret``, as hex."""
    return hmac.new(secret, content.encode("utf-8"), hashlib.sha256).hexdigest()


def seed_secret(seed: int) -> bytes:
    """A run's own secret: its seed (kept in the key store while the run can resume, then deleted)."""
    return seed.to_bytes(8, "big")
