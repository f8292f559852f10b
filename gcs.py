"""Cloud Storage (``gs://``) through gcsfs, with bounded waits and one line for each way it can be out of reach.

gcsfs retries a failed request six times (about 35 s of back-off), waits as long as aiohttp lets it
(5 minutes) for a server that accepted the connection and says nothing, and its file system answers
"no such file" when the server could not be asked at all; a command on an unreachable bucket then
said, a minute later, that the run directory held no run. Here:

* ``GcsFileSystem`` is gcsfs's client, except that a server that is not there (no network, a DNS
  failure, a refused connection) is tried ``CONNECT_ATTEMPTS`` times within seconds, a silent one
  is given up after ``timeout()`` seconds, and a server that answers but is busy (429, 5xx) keeps a
  back-off like gcsfs's; the final failure, and any refusal (no credentials, no permission), is a
  ``CloudStorageError``, one line naming the cause, which no caller mistakes for a missing file.
* ``GcsFileSystem.check_bucket`` lists one object of a bucket the first time a process uses it, so
  that a missing bucket, missing credentials or a wrong permission is said at once, by name, before
  any library (zarr, orbax's tensorstore, ArrayRecord, Beam) tries the bucket its own way.

``DPSCALE_GCS_TIMEOUT`` (seconds) sets how long a silent server is waited for.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
from collections.abc import Callable
from typing import Any

import aiohttp
import google.auth.exceptions
from fsspec.asyn import sync
from gcsfs.core import GCSFileSystem
from gcsfs.retry import HttpError, NonRetryableError

from dpscale.errors import CloudStorageError

TIMEOUT_VARIABLE = "DPSCALE_GCS_TIMEOUT"
DEFAULT_TIMEOUT = 15.0  # seconds a server may stay silent (a listing or an object's first bytes)
CONNECT_ATTEMPTS = 3  # a server that cannot be reached, tried again after CONNECT_BACKOFF, then twice that
CONNECT_BACKOFF = 0.5  # seconds
BUSY_ATTEMPTS = 6  # a server that answers 429 / 5xx, with gcsfs's back-off (up to ~30 s)
_BUSY = {408, 429, 500, 502, 503, 504}
_AGAIN = "check the network, then run the command again"
_SIGN_IN = (
    "sign in with `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS to a key "
    "file, then run the command again"
)


def timeout() -> float:
    """Seconds a silent server is waited for (``DPSCALE_GCS_TIMEOUT``, else ``DEFAULT_TIMEOUT``)."""
    value = os.environ.get(TIMEOUT_VARIABLE, "")
    try:
        seconds = float(value) if value else DEFAULT_TIMEOUT
    except ValueError:
        raise CloudStorageError(f"{TIMEOUT_VARIABLE}={value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise CloudStorageError(f"{TIMEOUT_VARIABLE}={value!r} must be a positive number of seconds")
    return seconds


def _host(fs: GCSFileSystem) -> str:
    return fs._location.split("://", 1)[-1].rstrip("/")


def unreachable(fs: GCSFileSystem, exc: BaseException) -> CloudStorageError:
    """The line for a server that could not be reached, from aiohttp's error."""
    host = _host(fs)
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        why = f"{host} cannot be resolved (no network, or a DNS failure)"
    elif isinstance(exc, aiohttp.ClientConnectorError):
        error = exc.os_error
        reason = os.strerror(error.errno) if getattr(error, "errno", None) else str(error or exc)
        why = f"cannot connect to {host} ({reason[:1].lower() + reason[1:]})"
    elif isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        why = f"{host} did not answer within {timeout():g} s ({TIMEOUT_VARIABLE} sets the wait)"
    else:
        why = f"the connection to {host} failed ({' '.join(str(exc).split()) or type(exc).__name__})"
    return CloudStorageError(f"Cloud Storage cannot be reached: {why}; {_AGAIN}")


def refusal(exc: BaseException) -> CloudStorageError | None:
    """The line for a server (or the credentials) that refused, or None if ``exc`` is something else."""
    if isinstance(exc, (google.auth.exceptions.GoogleAuthError, NonRetryableError)):
        return CloudStorageError(f"Google Cloud credentials could not be used ({_first_line(exc)}); {_SIGN_IN}")
    if isinstance(exc, HttpError) and exc.code == 401:
        return CloudStorageError(
            f"Cloud Storage refused the request: no valid credentials ({_first_line(exc)}); {_SIGN_IN}"
        )
    if isinstance(exc, OSError) and str(exc).startswith("Forbidden"):  # gcsfs's 403
        detail = str(exc).split("\n", 1)[-1].strip() or str(exc)
        return CloudStorageError(
            f"Cloud Storage denied access ({' '.join(detail.split())[:200]}); use an account "
            "that may read and write there (or another path), then run the command again"
        )
    return None


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(getattr(exc, "message", "") or exc).split())
    return text[:200] or type(exc).__name__


def _bounded(method: Callable[..., Any]) -> Callable[..., Any]:
    """gcsfs's request coroutine ``method`` without its own retries, with the ones above."""
    raw = getattr(method, "__wrapped__", None)
    if raw is None:  # a gcsfs whose methods are not wrapped by its retry decorator: keep its own policy
        return method

    async def call(self: GCSFileSystem, *args: Any, **kwargs: Any) -> Any:
        attempt = 0
        while True:
            attempt += 1
            try:
                return await raw(self, *args, **kwargs)
            except (TimeoutError, aiohttp.ServerTimeoutError) as exc:  # silent: waited long enough
                raise unreachable(self, exc) from None
            except aiohttp.ClientConnectionError as exc:
                if attempt >= CONNECT_ATTEMPTS:
                    raise unreachable(self, exc) from None
                await asyncio.sleep(CONNECT_BACKOFF * attempt)
            except HttpError as exc:
                refused = refusal(exc)
                if refused is not None:
                    raise refused from None
                if exc.code not in _BUSY:
                    raise
                if attempt >= BUSY_ATTEMPTS:
                    raise CloudStorageError(
                        f"Cloud Storage kept failing (HTTP {exc.code}: {_first_line(exc)}); try again later"
                    ) from None
                await asyncio.sleep(min(random.random() + 2 ** (attempt - 1), 32))
            except (OSError, google.auth.exceptions.GoogleAuthError, NonRetryableError) as exc:
                refused = refusal(exc)  # FileNotFoundError, FileExistsError: answers, not failures
                if refused is None:
                    raise
                raise refused from None

    call.__name__ = call.__qualname__ = raw.__name__
    call.__doc__ = raw.__doc__
    return call


def _default_token() -> str:
    """The credentials gcsfs would find without being told, found within seconds.

    Google's default credentials (a key file, ``gcloud auth application-default login``, a cloud
    VM's service account), else anonymous access, which a private bucket refuses with 401: the
    line then says to sign in. Left to itself, gcsfs asks the metadata server of a cloud VM once
    more after Google's lookup already found none, with five retries (benchmarks/results/first_hour.md
    has what that cost off the cloud).
    """
    try:
        google.auth.default()
    except google.auth.exceptions.DefaultCredentialsError:
        return "anon"
    return "google_default"


class GcsFileSystem(GCSFileSystem):
    """gcsfs's JSON-API client with the bounded waits and the one-line failures of this module."""

    _request = _bounded(GCSFileSystem._request)
    _get_file_request = _bounded(GCSFileSystem._get_file_request)
    _get_file_concurrent = _bounded(GCSFileSystem._get_file_concurrent)

    _checked: set[tuple[str, str]] = set()  # (server, bucket) pairs this process has reached
    _checking = threading.Lock()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        seconds = timeout()
        kwargs.setdefault("requests_timeout", aiohttp.ClientTimeout(sock_connect=seconds, sock_read=seconds))
        if kwargs.get("token") is None:
            kwargs["token"] = _default_token()
        super().__init__(*args, **kwargs)

    def check_bucket(self, url: str) -> None:
        """Reach the bucket of ``url`` once per process: one line if it is missing, refused or unreachable."""
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        key = (self._location, bucket)
        if not bucket or key in self._checked:
            return
        with self._checking:
            if key in self._checked:
                return
            try:
                sync(self.loop, self._call, "GET", "b/{}/o", bucket, maxResults=1, json_out=True)
            except FileNotFoundError:
                raise CloudStorageError(
                    f"{url!r}: the bucket {bucket!r} does not exist (or these credentials "
                    f"cannot see it) at {_host(self)}"
                ) from None
            except CloudStorageError as exc:
                raise CloudStorageError(f"{url!r}: {exc}") from None
            self._checked.add(key)
