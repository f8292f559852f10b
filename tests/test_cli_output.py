"""What the command line writes besides results: no warnings about optional parts that are not in use."""

from __future__ import annotations

import subprocess
import sys

# A plain install (no gcp extra): the google.cloud namespace is there (other google packages bring it) and its
# storage client is not, so importing Beam's GCSFileSystem fails with an ImportError that Beam (before 2.78)
# logs as a warning.
WITHOUT_STORAGE = """
import sys


class NoStorage:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[:3] == ["google", "cloud", "storage"]:
            raise ImportError("cannot import name 'storage' from 'google.cloud'")


sys.meta_path.insert(0, NoStorage())
"""
WARNING = "Failed to import GCSFileSystem"


def _python(code: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_STORAGE + code, *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def _beam_version() -> tuple[int, int]:
    import apache_beam

    major, minor = apache_beam.__version__.split(".")[:2]
    return int(major), int(minor)


def test_beam_warns_about_its_gcs_file_system_on_a_plain_install_before_2_78():
    """The situation the next test is about. Beam before 2.78 imports Cloud Storage's client with its GCS file
    system and warns when it is missing; 2.78 loads the file system without it (and says "GCP dependencies are
    not installed" only when a ``gs://`` path reaches Beam), so a plain install imports Beam without a word.
    Either way the next test holds dpscale's output to no such warning; this one says which case it checked."""
    stderr = _python("import apache_beam").stderr
    assert (WARNING in stderr) == (_beam_version() < (2, 78)), stderr


def test_a_beam_stage_on_a_plain_install_prints_no_warning_about_file_systems_it_does_not_use(tmp_path):
    done = _python(
        "from dpscale.cli import main\nsys.argv[0] = 'dpscale'\nmain()",
        "ingest",
        "digits",
        str(tmp_path / "digits"),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert WARNING not in done.stderr and "Failed to import" not in done.stderr, done.stderr
