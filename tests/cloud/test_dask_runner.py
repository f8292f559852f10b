"""ingest, dedup and featurize on Beam's DaskRunner against a dask.distributed cluster on localhost.

The outputs must be those of the local runner, file for file (shards, manifests, reports) and
array for array (feature caches).
"""

import filecmp
import json

import jax
import jax.numpy as jnp
import numpy as np
from click.testing import CliRunner
from PIL import Image

from dpscale.cache.feature_store import open_features
from dpscale.cli import cli
from dpscale.models import pretrained


def _run(args, scheduler=None):
    beam = ["--", "--runner", "DaskRunner", "--dask_client_address", scheduler] if scheduler else []
    result = CliRunner().invoke(cli, [*args, *beam])
    assert result.exit_code == 0, result.output
    return result


def _same_files(a, b):
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and names
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


def _folder_source(root):
    """train/{a,b,c,d}: 12 random 8x8 images each; one 'a' image copies a 'c' one (dedup removes it)."""
    rng = np.random.default_rng(0)
    images = {}
    for k, cls in enumerate("abcd"):
        (root / "train" / cls).mkdir(parents=True)
        for i in range(12):
            images[cls, i] = np.clip(rng.integers(0, 120, (8, 8)) + 40 * k, 0, 255).astype(np.uint8)
            Image.fromarray(images[cls, i]).save(root / "train" / cls / f"{i}.png")
    Image.fromarray(images["c", 0]).save(root / "train" / "a" / "copy-of-c0.png")
    return f"folder:{root}"


def test_ingest_and_dedup_on_dask_equal_the_local_runner(dask_scheduler, tmp_path):
    for where, scheduler in (("local", None), ("dask", dask_scheduler)):
        _run(["ingest", "digits", str(tmp_path / where / "digits")], scheduler)
    _same_files(tmp_path / "local" / "digits", tmp_path / "dask" / "digits")

    source = _folder_source(tmp_path / "src")
    _run(["ingest", source, str(tmp_path / "public"), "--classes", "a,b"])
    _run(["ingest", source, str(tmp_path / "private"), "--classes", "c,d"])
    for where, scheduler in (("local", None), ("dask", dask_scheduler)):
        _run(["dedup", str(tmp_path / "public"), str(tmp_path / "private"), str(tmp_path / where / "dedup")], scheduler)
    _same_files(tmp_path / "local" / "dedup", tmp_path / "dask" / "dedup")
    assert '"num_removed": 1' in (tmp_path / "dask" / "dedup" / "dedup_report.NOT-PRIVATE.json").read_text()


def test_featurize_on_dask_gives_the_local_runner_s_features(dask_scheduler, tmp_path):
    _run(["ingest", "digits", str(tmp_path / "digits")])
    model = pretrained.build_model("cnn-small", num_classes=10)
    variables = model.init(jax.random.key(1), jnp.zeros((1, 8, 8, 1), jnp.float32))
    backbone = str(tmp_path / "backbone")
    pretrained.save_pretrained(
        backbone,
        variables,
        model="cnn-small",
        num_classes=10,
        preprocessing=pretrained.Preprocessing(resolution=8, mean=(127.5,), std=(127.5,)),
    )
    entries = {}
    for where, scheduler in (("local", None), ("dask", dask_scheduler)):
        result = _run(
            [
                "featurize",
                str(tmp_path / "digits"),
                "--backbone",
                backbone,
                "--cache-dir",
                str(tmp_path / where),
                "--chunk-rows",
                "512",
            ],
            scheduler,
        )
        entries[where] = open_features(json.loads(result.stdout.strip().splitlines()[-1])["path"])
    local, dask = entries["local"], entries["dask"]
    assert local.splits == dask.splits == ["test", "train"]
    for split in local.splits:
        np.testing.assert_array_equal(local.features(split)[:], dask.features(split)[:])
        np.testing.assert_array_equal(local.labels(split), dask.labels(split))
        assert local.ids(split) == dask.ids(split)
