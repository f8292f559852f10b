"""The Dataflow job each data command would submit, built offline (``--dry_run``) and checked.

Inputs and outputs are on gs:// (the local GCS API server); the job carries real-looking
options and dpscale as a wheel for the workers. Nothing is submitted: Beam's dry run stops
after building the job, and dpscale writes its description (options, portable pipeline).
"""

import base64
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from click.testing import CliRunner

from dpscale import files
from dpscale.cli import cli
from dpscale.models import pretrained

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """dpscale as the workers would install it (built here, offline, from this checkout)."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    [built] = out.glob("dpscale-*.whl")
    return built


def _dataflow(gcs, wheel, job):
    return [
        "--",
        "--runner",
        "DataflowRunner",
        "--project",
        "dpscale-test",
        "--region",
        "europe-west4",
        "--temp_location",
        f"{gcs}/dataflow-tmp",
        "--extra_package",
        str(wheel),
        "--dry_run",
        "True",
        "--dataflow_job_file",
        str(job),
    ]


def _built_job(args, job):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output  # nothing ran: the command's outputs do not exist
    [line] = [ln for ln in result.stderr.splitlines() if ln.startswith("dpscale: error:")]
    assert "dry run" in line and str(job) in line, line
    described = json.loads(job.read_text())
    transforms = {t["uniqueName"] for t in described["pipeline"]["components"]["transforms"].values()}
    environments = described["pipeline"]["components"]["environments"].values()
    # each staged artifact: where it is read from and the name it is staged as (protobuf payloads)
    staged = " ".join(
        base64.b64decode(d.get(k, "")).decode("utf-8", "replace")
        for e in environments
        for d in e.get("dependencies", [])
        for k in ("typePayload", "rolePayload")
    )
    return described["options"], transforms, staged


def _check_options(options, gcs, wheel):
    assert options["runner"] == "DataflowRunner" and options["project"] == "dpscale-test"
    assert options["region"] == "europe-west4" and options["temp_location"] == f"{gcs}/dataflow-tmp"
    assert options["extra_packages"] == [str(wheel)]


def test_ingest_dedup_and_featurize_build_their_dataflow_jobs(gcs, gs_dir, wheel, tmp_path):
    data = f"{gs_dir}/digits"
    job = tmp_path / "ingest.json"
    options, transforms, staged = _built_job(["ingest", "digits", data, *_dataflow(gcs, wheel, job)], job)
    _check_options(options, gcs, wheel)
    assert {"ReadDecodeEncode", "WriteShards", "WriteManifest"} <= transforms
    assert wheel.name in staged  # the workers install dpscale from the staged wheel
    assert not files.exists(f"{data}/manifest.json")

    # real inputs for the other two: digits split in two by class, on gs://, with the local runner
    for name, classes in (("public", "0,1,2,3,4"), ("private", "5,6,7,8,9")):
        result = CliRunner().invoke(cli, ["ingest", "digits", f"{gs_dir}/{name}", "--classes", classes])
        assert result.exit_code == 0, result.output
    job = tmp_path / "dedup.json"
    options, transforms, staged = _built_job(
        ["dedup", f"{gs_dir}/public", f"{gs_dir}/private", f"{gs_dir}/dedup", *_dataflow(gcs, wheel, job)], job
    )
    _check_options(options, gcs, wheel)
    assert {"Describe", "Neighbours", "Verify", "WriteShards", "WriteReport"} <= transforms and wheel.name in staged

    model = pretrained.build_model("cnn-small", num_classes=5)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1), jnp.float32))
    backbone = f"{gs_dir}/backbone"
    pretrained.save_pretrained(
        backbone,
        variables,
        model="cnn-small",
        num_classes=5,
        preprocessing=pretrained.Preprocessing(resolution=8, mean=(127.5,), std=(127.5,)),
    )
    job = tmp_path / "featurize.json"
    options, transforms, staged = _built_job(
        [
            "featurize",
            f"{gs_dir}/private",
            "--backbone",
            backbone,
            "--cache-dir",
            f"{gs_dir}/cache",
            *_dataflow(gcs, wheel, job),
        ],
        job,
    )
    _check_options(options, gcs, wheel)
    assert "FeaturizeChunks" in transforms and wheel.name in staged


def test_a_dataflow_job_without_dpscale_for_its_workers_is_refused_in_one_line(gs_dir, tmp_path):
    result = CliRunner().invoke(
        cli,
        [
            "ingest",
            "digits",
            f"{gs_dir}/digits",
            "--",
            "--runner",
            "DataflowRunner",
            "--project",
            "p",
            "--region",
            "r",
            "--temp_location",
            f"{gs_dir}/tmp",
        ],
    )
    assert result.exit_code == 2
    [line] = [ln for ln in result.stderr.splitlines() if ln.startswith("dpscale: error:")]
    assert "--setup_file" in line and "--extra_package" in line and "--sdk_container_image" in line
