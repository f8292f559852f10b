"""Multi-host training (``dpscale.distributed``): flag checks, batch placement, and a real
two-process run on localhost CPU that must equal the single-process run.

The two-process test launches two ``dpscale train`` processes that meet through
``jax.distributed`` (gloo CPU collectives) with 2 CPU devices each, i.e. the same
4 global devices as this test process.
"""

import json
import os
import pathlib
import socket
import stat
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from click.testing import CliRunner
from jax.sharding import PartitionSpec

from dpscale import distributed
from dpscale.cli import cli
from dpscale.errors import InvalidConfigError
from dpscale.privacy.plan import PrivacyTarget
from dpscale.privacy.sampling import Layout, pad_into
from dpscale.stages import train
from dpscale.training.config import TrainingConfig
from dpscale.training.feeds import FeatureFeed
from dpscale.training.run_directory import RunDirectory


@pytest.mark.parametrize(
    "args, match",
    [
        (("127.0.0.1:1234", None, None), "needs all of"),
        ((None, 2, 0), "needs all of"),
        (("no-port", 2, 0), "HOST:PORT"),
        (("127.0.0.1:1234", 0, 0), "num-processes"),
        (("127.0.0.1:1234", 2, 2), r"process-id must be in \[0, 2\)"),
    ],
)
def test_initialize_rejects_incomplete_or_bad_flags(args, match):
    with pytest.raises(InvalidConfigError, match=match):
        distributed.initialize(*args)


def test_initialize_without_flags_is_a_single_process_run():
    assert distributed.initialize() is False
    with pytest.raises(InvalidConfigError, match="takes none of"):
        distributed.initialize("127.0.0.1:1234", 2, 0, auto=True)


def test_train_cli_reports_incomplete_multihost_flags_in_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["train", str(tmp_path / "d"), str(tmp_path / "r"), "--num-processes", "2"])
    assert result.exit_code == 2
    assert "needs all of --coordinator-address" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_single_process_helpers_do_not_communicate():
    seed = 2**62 + 12345  # more than 32 bits survive
    assert distributed.agree_on_seed(seed) == seed
    assert distributed.run_on_primary(lambda: "done") == "done"
    assert distributed.is_primary()


def test_placement_shards_the_rows_over_the_mesh_and_checks_divisibility():
    mesh = distributed.training_mesh()
    placement = distributed.BatchPlacement(mesh)
    assert placement.num_devices == 4
    np.testing.assert_array_equal(placement.rows(8), np.arange(8))  # one process holds every row
    local = {"x": np.arange(16.0).reshape(8, 2), "y": np.arange(8, dtype=np.int32)}
    placed = placement.put(local, 8)
    assert placed["x"].sharding.spec == PartitionSpec("data")
    assert [s.data.shape for s in placed["x"].addressable_shards] == [(2, 2)] * 4
    np.testing.assert_array_equal(np.asarray(placed["x"]), local["x"])
    np.testing.assert_array_equal(np.asarray(placed["y"]), local["y"])
    with pytest.raises(InvalidConfigError, match="not divisible by the 4 devices"):
        placement.rows(6)


def test_local_rows_follow_the_mesh_order():
    """A mesh whose devices are permuted still gives each device a contiguous block of rows."""
    devices = jax.devices()[::-1]
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("data",)), PartitionSpec("data"))
    np.testing.assert_array_equal(distributed.local_rows(sharding, 12), np.arange(12))
    by_device = sharding.addressable_devices_indices_map((12,))
    assert by_device[devices[0]][0].indices(12)[:2] == (0, 3)


def test_feature_feed_places_padded_microbatches_like_the_plain_feed():
    feats = np.arange(24.0, dtype=np.float32).reshape(6, 4)
    batch = pad_into(np.array([0, 2, 5]), Layout(num_microbatches=1, microbatch_size=4))
    plain = FeatureFeed(feats, np.arange(6) % 3).microbatches(batch, step=0)
    placed = FeatureFeed(feats, np.arange(6) % 3, distributed.BatchPlacement(distributed.training_mesh())).microbatches(
        batch, step=0
    )
    for (a, mask_a), (b, mask_b) in zip(plain, placed):
        np.testing.assert_array_equal(np.asarray(mask_a), np.asarray(mask_b))
        for name in a:
            np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))


# -- a real two-process run ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def features(tmp_path_factory, synthetic_feature_cache):
    """A 3-class problem in 16 dimensions as a real feature-cache entry."""
    return synthetic_feature_cache(
        str(tmp_path_factory.mktemp("cache")),
        seed=1,
        sizes={"train": 400, "test": 60},
        chunk_rows=512,
        data_hash_char="e",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    args: list[str], num_processes: int, timeout: float, logs: pathlib.Path, module: str | None = "dpscale"
) -> list[str]:
    """Run ``python -m module args`` once per process (2 CPU devices each); kill all on failure.

    The distributed flags follow ``args``: ``dpscale``'s options, or for a script
    (``module=None``) its two positional arguments (address, process id).

    Output goes to files, not pipes: a process blocked on a full pipe would stall
    the others in their next collective.
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    address = f"127.0.0.1:{_free_port()}"
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(num_processes):
        with open(logs / f"{i}.out", "w") as out, open(logs / f"{i}.err", "w") as err:
            flags = (
                [address, str(i)]
                if module is None
                else ["--coordinator-address", address, "--num-processes", str(num_processes), "--process-id", str(i)]
            )
            command = [sys.executable, *(["-m", module] if module else []), *args, *flags]
            procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [
        f"process {i} exited with {p.returncode}:\n{(logs / f'{i}.err').read_text()[-2000:]}"
        for i, p in enumerate(procs)
        if p.returncode != 0
    ]
    assert not failed, "\n".join(failed)
    return [(logs / f"{i}.out").read_text() for i in range(num_processes)]


_AGREEMENT_WORKER = """
import sys
from dpscale import distributed
from dpscale.errors import DpscaleError, InvalidConfigError

distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
me = int(sys.argv[2])
print("seed", distributed.agree_on_seed(2**62 + 7 if me == 0 else 5))
print("setup", distributed.run_on_primary(lambda: "made"))
try:
    distributed.run_on_primary(lambda: 1 / 0)
except ZeroDivisionError:
    print("failed on", me)
except DpscaleError:
    print("told", me)
distributed.check_same_everywhere("same", "the text")
try:
    distributed.check_same_everywhere(f"process {me}", "the text")
except InvalidConfigError as exc:
    print("refused", exc)
"""


@pytest.mark.multihost
def test_processes_agree_on_process_0s_seed_and_setup_and_refuse_other_configs(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_AGREEMENT_WORKER)
    out = _launch([str(script)], num_processes=2, timeout=200, logs=tmp_path / "logs", module=None)
    for me, text in enumerate(out):
        lines = text.splitlines()
        assert f"seed {2**62 + 7}" in lines  # all 64 bits of process 0's seed
        assert f"setup {'made' if me == 0 else None}" in lines
        assert ("failed on 0" if me == 0 else "told 1") in lines
        assert any(line.startswith("refused the text differs between process 0 and process(es) [1]") for line in lines)


@pytest.mark.multihost
def test_two_processes_train_exactly_like_one(features, tmp_path):
    """Two processes == one process with the same seed (process 0's seed reaches every process:
    ``test_processes_agree_on_process_0s_seed_and_setup_and_refuse_other_configs``)."""
    run_dir = tmp_path / "two"
    steps, seed = 3, 2**62 + 99
    # About 40 s on a lightly loaded 2-core machine; the timeout leaves room for a heavily loaded one.
    outputs = _launch(
        [
            "train",
            features,
            str(run_dir),
            "--mode",
            "features",
            "--epsilon",
            "2",
            "--batch-size",
            "64",
            "--steps",
            str(steps),
            "--microbatch-size",
            "16",
            "--learning-rate",
            "4",
            "--checkpoint-every",
            "100",
            "--seed",
            str(seed),
            "--private-diagnostics",
        ],
        num_processes=2,
        timeout=400,
        logs=tmp_path / "logs",
    )
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    for result in results:  # wall times differ between processes; everything else must not
        del result["train_seconds"], result["examples_per_second"]
        result["final_metrics"].pop("seconds", None)  # per-step time: a private diagnostic, not in the line
    assert results[0] == results[1]

    # Only process 0 wrote the run's files: one metrics line per step; the secrets are gone at the end.
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    diagnostics = run_dir / "diagnostics.NOT-PRIVATE.jsonl"
    assert stat.S_IMODE(diagnostics.stat().st_mode) == 0o600
    assert not (run_dir / "seed.json").exists() and not RunDirectory(str(run_dir)).has_secrets
    assert json.loads((run_dir / "ledger.json").read_text())["steps_done"] == steps

    reference = train.run(
        train.TrainConfig(
            data=features,
            run_dir=str(tmp_path / "one"),
            training=TrainingConfig(
                mode="features",
                target=PrivacyTarget(2.0),
                batch_size=64,
                steps=steps,
                microbatch_size=16,
                learning_rate=4.0,
                checkpoint_every=100,
                seed=seed,
                show_progress=False,
                private_diagnostics=True,
            ),
        )
    )
    assert reference.epsilon == results[0]["epsilon"]
    sizes = [
        [json.loads(line)["batch_size"] for line in (directory / diagnostics.name).read_text().splitlines()]
        for directory in (run_dir, tmp_path / "one")
    ]
    assert sizes[0] == sizes[1]  # the same Poisson batches
    got = RunDirectory(str(run_dir)).load_params()
    want = RunDirectory(str(tmp_path / "one")).load_params()
    for key in ("params", "ema_params"):
        for a, b in zip(jax.tree_util.tree_leaves(got[key]), jax.tree_util.tree_leaves(want[key])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
