"""The sweep stage on feature-cache entries: tables, reuse, composition, honest selection, baseline, simulation."""

import csv
import dataclasses
import json
import math
import os
import re
import shutil

import dp_accounting
import numpy as np
import pytest

from dpscale.errors import DataError, InvalidConfigError
from dpscale.privacy.plan import PrivacyTarget, composed_epsilon
from dpscale.stages import evaluate, sweep
from dpscale.training.config import FeatureSettings, TrainingConfig
from dpscale.training.grid import SIMULATION_FILE, SIMULATION_NOTE
from dpscale.training.run_directory import RunDirectory
from dpscale.training.sweep_directory import SELECTION_DIR

from ..conftest import write_feature_cache, write_synthetic_feature_cache

SIZES = {"train": 600, "test": 150}


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    return write_synthetic_feature_cache(
        str(tmp_path_factory.mktemp("cache")), seed=0, sizes=SIZES, chunk_rows=256, data_hash_char="d"
    )


def _training(**overrides):
    base = dict(
        mode="features",
        target=PrivacyTarget(epsilon=math.inf, accountant="rdp"),
        batch_size=128,
        steps=4,
        microbatch_size=64,
        show_progress=False,
    )
    return TrainingConfig(**(base | overrides))


def _config(features, out_dir, **overrides):
    training = _training(**overrides.pop("training", {}))
    base = dict(
        data=features, out_dir=str(out_dir), training=training, epsilons=(2.0,), learning_rates=(4.0,), repeats=1
    )
    return sweep.SweepConfig(**(base | overrides))


def _files(directory):
    return sorted(
        os.path.relpath(os.path.join(root, name), directory) for root, _, names in os.walk(directory) for name in names
    )


def test_sweep_writes_tables_and_plot_and_reuses_finished_runs(features, tmp_path):
    config = _config(features, tmp_path / "sweep", epsilons=(1.0, 4.0), repeats=2)
    result = sweep.run(config)
    assert {s["epsilon"] for s in result.summary} == {1.0, 4.0}
    assert all(s["repeats"] == 2 and s["min_top1"] <= s["median_top1"] <= s["max_top1"] for s in result.summary)
    out = tmp_path / "sweep"
    assert (out / sweep.PLOT).stat().st_size > 1000
    summary_md = (out / sweep.SUMMARY_MD).read_text()
    assert "no setting was chosen" in summary_md and result.chosen == () and "no setting" in result.selection
    assert len((out / sweep.RUNS_CSV).read_text().splitlines()) == 1 + 2 * 2  # header, 2 epsilons x 2 repeats
    assert result.covered_by_epsilon and not (out / sweep.BASELINE_DIR).exists()  # no baseline by default
    stamp = (out / "runs" / "eps1-lr4-r0" / "metrics.json").stat().st_mtime_ns
    assert sweep.run(config).summary == result.summary  # everything reused: same numbers
    assert (out / "runs" / "eps1-lr4-r0" / "metrics.json").stat().st_mtime_ns == stamp


def test_a_nan_canary_leaves_no_trace_in_the_default_outputs(tmp_path):
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(3, 16)) * 3
    labels = rng.integers(0, 3, size=600)
    x = (centers[labels] + rng.normal(size=(600, 16))).astype(np.float32)
    x[17] = np.nan  # the canary
    test_labels = rng.integers(0, 3, size=150)
    entry = write_feature_cache(
        str(tmp_path / "cache"),
        {"train": (x, labels), "test": (centers[test_labels] + rng.normal(size=(150, 16)), test_labels)},
        chunk_rows=256,
        data_hash_char="c",
    )
    out = tmp_path / "sweep"
    sweep.run(_config(entry, out))
    assert not (out / sweep.BASELINE_DIR).exists()
    for name in _files(out):
        if name.endswith((".png", ".secret")) or "/checkpoints/" in name or "/params/" in name:
            continue
        text = (out / name).read_text().lower().replace(str(tmp_path).lower(), "")
        assert "nan" not in text.replace("nonprivate", ""), name
        assert "loss" not in text and "batch_sizes" not in text, name


def test_the_baseline_is_a_private_diagnostic_kept_apart(features, tmp_path):
    out = tmp_path / "sweep"
    result = sweep.run(_config(features, out, baseline=True))
    baseline = out / sweep.BASELINE_DIR
    assert os.stat(baseline).st_mode & 0o777 == 0o700
    assert sorted(os.listdir(baseline / "runs")) == ["nonprivate-lr0.5-r0"]
    for name in ("summary.NOT-PRIVATE.md", "runs.NOT-PRIVATE.csv", "summary.NOT-PRIVATE.csv"):
        assert os.stat(baseline / name).st_mode & 0o777 == 0o600
    assert "NOT private" in (baseline / "summary.NOT-PRIVATE.md").read_text()
    # The DP tables hold DP runs only; privacy.json lists the baseline as not covered.
    assert "nonprivate" not in (out / sweep.SUMMARY_MD).read_text() + (out / sweep.RUNS_CSV).read_text()
    assert all(math.isfinite(s["epsilon"]) for s in result.summary) and result.baseline[0]["private"] is False
    privacy = json.loads((out / sweep.PRIVACY_JSON).read_text())
    assert privacy["non_private_runs"] == ["baseline.NOT-PRIVATE/runs/nonprivate-lr0.5-r0"]
    assert any("baseline" in note for note in privacy["not_covered"]) and privacy["private_runs"] == 1
    assert any("baseline" in w for w in result.warnings)


def test_reuse_is_refused_for_other_settings_and_for_other_data(features, tmp_path):
    out = tmp_path / "sweep"
    sweep.run(_config(features, out))
    before = {name: (out / name).read_bytes() for name in _files(out) if not name.endswith(".png")}
    with pytest.raises(DataError, match=r"batch-size 128 there, 64 asked.*new OUT_DIR"):
        sweep.run(_config(features, out, training=dict(batch_size=64)))
    with pytest.raises(DataError, match=r"clip-norm 1.0 there, 2.0 asked"):
        sweep.run(_config(features, out, training=dict(clip_norm=2.0)))
    other = write_synthetic_feature_cache(
        str(tmp_path / "other"), seed=1, sizes=SIZES, chunk_rows=256, data_hash_char="e"
    )
    with pytest.raises(DataError, match="holds a sweep on other data.*new OUT_DIR"):
        sweep.run(_config(other, out))
    assert {name: (out / name).read_bytes() for name in before} == before  # nothing overwritten


def test_reuse_is_refused_when_the_data_at_the_same_path_changed(tmp_path):
    root = str(tmp_path / "cache")
    entry = write_synthetic_feature_cache(root, seed=0, sizes=SIZES, chunk_rows=256, data_hash_char="d")
    out = tmp_path / "sweep"
    sweep.run(_config(entry, out))
    shutil.rmtree(root)
    assert write_synthetic_feature_cache(root, seed=5, sizes=SIZES, chunk_rows=256, data_hash_char="d") == entry
    with pytest.raises(DataError, match="same path, other content"):
        sweep.run(_config(entry, out))
    assert entry not in (out / sweep.RECORD).read_text().split('"data_identity"')[1]  # keyed, not the path


def test_runs_of_an_older_sweep_without_a_record_are_not_reused(features, tmp_path):
    out = tmp_path / "sweep"
    sweep.run(_config(features, out))
    (out / sweep.RECORD).unlink()
    with pytest.raises(DataError, match="without a record of their data"):
        sweep.run(_config(features, out))


def test_privacy_json_composes_every_run_of_every_invocation(features, tmp_path):
    out = tmp_path / "sweep"
    first = sweep.run(_config(features, out, epsilons=(1.0,)))
    second = sweep.run(_config(features, out, epsilons=(2.0,), learning_rates=(2.0,)))
    privacy = json.loads((out / sweep.PRIVACY_JSON).read_text())
    assert privacy["private_runs"] == second.private_runs == 2
    assert sorted(r["run_dir"] for r in privacy["runs"]) == ["runs/eps1-lr4-r0", "runs/eps2-lr2-r0"]
    plans = [RunDirectory.existing(str(out / r["run_dir"])).read_spec().plan for r in privacy["runs"]]
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(p.sampling_rate, dp_accounting.GaussianDpEvent(p.noise_multiplier)),
                p.steps,
            )
            for p in plans
        ]
    )
    untruncated = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
    assert privacy["composed_epsilon"] == pytest.approx(
        composed_epsilon(plans, delta=1e-5, accountant=privacy["accountant"]), rel=1e-9
    )
    # The runs' batches are truncated Poisson, whose capacity is chosen to cost at most 0.1% of epsilon.
    assert privacy["composed_epsilon"] == pytest.approx(untruncated, rel=1.1e-3)
    assert second.composed_epsilon > max(first.composed_epsilon, 2.0 * 0.99)
    assert len(second.rows) == 1  # the tables are this grid's; the record is the directory's


@pytest.fixture(scope="module")
def disagreeing(tmp_path_factory):
    """Held-out rows labelled truly, test rows labelled one class off: the better model scores worse on test."""
    rng = np.random.default_rng(3)
    centers = rng.normal(size=(3, 16)) * 3
    train_labels = rng.integers(0, 3, size=600)
    test_labels = rng.integers(0, 3, size=150)
    splits = {
        "train": (centers[train_labels] + rng.normal(size=(600, 16)), train_labels),
        "test": (centers[test_labels] + rng.normal(size=(150, 16)), (test_labels + 1) % 3),
    }
    return write_feature_cache(str(tmp_path_factory.mktemp("disagree")), splits, chunk_rows=256, data_hash_char="a")


def test_settings_are_chosen_on_held_out_rows_and_never_on_the_test_split(disagreeing, tmp_path, monkeypatch):
    evaluated = []
    real = evaluate.run

    def spy(config):
        evaluated.append((config.split, os.path.basename(config.run_dir)))
        return real(config)

    monkeypatch.setattr(evaluate, "run", spy)
    # Rows scaled to norm 1e-4 carry no signal past the noise: the bias learns the majority class, which
    # scores 1/3 on held-out rows and on the shifted test alike; scale 1 learns the true classes.
    config = _config(
        disagreeing,
        tmp_path / "sweep",
        epsilons=(1.0,),
        grid=(("feature_scale", (1e-4, 1.0)),),
        repeats=2,
        training=dict(holdout=150, private_diagnostics=True, steps=10, features=FeatureSettings(normalization="l2")),
    )
    result = sweep.run(config)
    by_scale = {s["feature_scale"]: s for s in result.summary}
    assert all(s["split"] == "holdout" for s in result.summary)
    assert by_scale[1.0]["median_top1"] > 0.9 and by_scale[1e-4]["median_top1"] < 0.5
    (chosen,) = result.chosen
    assert chosen["feature_scale"] == 1.0 and chosen["chosen_on"] == "holdout"
    assert chosen["test_median_top1"] < 0.1  # reported as it is
    # Held-out rows first, for every run; then the test split, for the chosen runs only.
    first_test = next(i for i, (split, _) in enumerate(evaluated) if split == "test")
    assert {split for split, _ in evaluated[:first_test]} == {"holdout"} and first_test == 4
    assert evaluated[first_test:] == [("test", "eps1-lr4-feature-scale1-r0"), ("test", "eps1-lr4-feature-scale1-r1")]
    # Chosen on the test split, the other setting would have won.
    other = real(evaluate.EvaluateConfig(run_dir=str(tmp_path / "sweep" / "runs" / "eps1-lr4-feature-scale0.0001-r0")))
    assert other.ema_top1 > 0.2 > chosen["test_median_top1"]
    out = tmp_path / "sweep"
    assert "Chosen on held-out training rows" in (out / "summary.NOT-PRIVATE.md").read_text()
    assert os.stat(out / "chosen.NOT-PRIVATE.csv").st_mode & 0o777 == 0o600
    with open(out / "chosen.NOT-PRIVATE.csv") as f:
        assert float(next(csv.DictReader(f))["feature_scale"]) == 1.0
    privacy = json.loads((out / sweep.PRIVACY_JSON).read_text())
    assert "held-out" in privacy["selection"] and any("choice" in n for n in privacy["not_covered"])
    assert not result.covered_by_epsilon


def test_a_held_out_sweep_leaves_no_readable_trace_of_its_choice_or_its_baseline(disagreeing, tmp_path, umask_022):
    """Twice into one folder, through the Python API under umask 022: what others may read is the same for every
    run (no metrics.json in the chosen runs only), and the JSON line withholds held-out and baseline scores."""
    from ..conftest import readable_by_others

    out = tmp_path / "sweep"
    config = _config(
        disagreeing,
        out,
        epsilons=(1.0,),
        grid=(("feature_scale", (1e-4, 1.0)),),
        baseline=True,
        training=dict(holdout=150, private_diagnostics=True, steps=10, features=FeatureSettings(normalization="l2")),
    )
    first = sweep.run(config)
    assert not any("replaced" in w for w in first.warnings)
    second = sweep.run(config)
    assert second.chosen == first.chosen and second.chosen[0]["feature_scale"] == 1.0
    readable = readable_by_others(str(out))
    by_run = {}
    for path in readable:
        assert "NOT-PRIVATE" not in path and not path.startswith(sweep.BASELINE_DIR), path
        if path.startswith("runs/"):
            by_run.setdefault(path.split("/")[1], set()).add(path.split("/")[2])  # checkpoints/ and params/: whole
    assert sorted(by_run) == ["eps1-lr4-feature-scale0.0001-r0", "eps1-lr4-feature-scale1-r0"]
    assert len({frozenset(names) for names in by_run.values()}) == 1  # every run alike: the choice is not there
    assert "metrics.json" not in next(iter(by_run.values()))
    assert sorted(p for p in readable if "/" not in p) == ["key.id", sweep.PRIVACY_JSON, sweep.RECORD]
    for name in (
        "runs.NOT-PRIVATE.csv",
        "summary.NOT-PRIVATE.md",
        "chosen.NOT-PRIVATE.csv",
        "accuracy_vs_epsilon.NOT-PRIVATE.png",
    ):
        assert os.stat(out / name).st_mode & 0o777 == 0o600, name
    assert any("replaced the owner-only tables" in w and "chosen.NOT-PRIVATE.csv" in w for w in second.warnings)
    line = json.loads(json.dumps(second.line()))
    assert not {"rows", "summary", "chosen", "baseline"} & set(line)
    assert line["withheld"]["fields"] == ["summary", "chosen", "baseline"]
    assert all(os.stat(f).st_mode & 0o777 == 0o600 for f in line["withheld"]["files"])
    shown = dataclasses.replace(second, print_private=True).line()
    assert list(shown["chosen"]) == list(second.chosen) and shown["not_private"]["fields"] == [
        "summary",
        "chosen",
        "baseline",
    ]


def test_a_later_sweep_never_makes_owner_only_tables_readable(features, tmp_path):
    out = tmp_path / "sweep"
    sweep.run(_config(features, out, training=dict(holdout=100, private_diagnostics=True)))
    later = sweep.run(_config(features, out, learning_rates=(2.0,)))  # another grid, nothing held out
    assert not (out / "runs.NOT-PRIVATE.csv").exists()  # the earlier grid's tables are gone ...
    for name in (sweep.RUNS_CSV, sweep.SUMMARY_CSV, sweep.SUMMARY_MD, sweep.PLOT):  # ... and these stay closed
        assert os.stat(out / name).st_mode & 0o777 == 0o600, name
    (warning,) = [w for w in later.warnings if "replaced the owner-only tables" in w]
    assert "runs.NOT-PRIVATE.csv" in warning and "summary.NOT-PRIVATE.md" in warning


def test_delta_of_at_least_one_over_n_is_warned_everywhere(features, tmp_path):
    out = tmp_path / "sweep"
    result = sweep.run(
        _config(features, out, training=dict(target=PrivacyTarget(epsilon=math.inf, delta=0.01, accountant="rdp")))
    )
    assert any("1/num_examples" in w for w in result.warnings)
    assert any("1/num_examples" in w for w in json.loads((out / sweep.PRIVACY_JSON).read_text())["warnings"])
    assert "Warning: delta = 0.01" in (out / sweep.SUMMARY_MD).read_text()
    # The command's JSON line carries it too (the run is reused: same data, same settings).
    from click.testing import CliRunner

    from dpscale.cli import cli

    line = CliRunner().invoke(
        cli,
        [
            "sweep",
            features,
            str(out),
            "--epsilons",
            "2",
            "--learning-rates",
            "4",
            "--repeats",
            "1",
            "--batch-size",
            "128",
            "--steps",
            "4",
            "--microbatch-size",
            "64",
            "--accountant",
            "rdp",
            "--delta",
            "0.01",
        ],
    )
    assert line.exit_code == 0, line.output
    assert any("1/num_examples" in w for w in json.loads(line.stdout)["warnings"])


def test_simulated_runs_say_they_are_not_private_at_their_target(features, tmp_path):
    out = tmp_path / "sweep"
    result = sweep.run(_config(features, out, simulate_batch=32))
    (name,) = os.listdir(out / "runs")
    assert name == "sim-b32-eps2-lr4-r0.NOT-PRIVATE"
    run = out / "runs" / name
    marker = json.loads((run / SIMULATION_FILE).read_text())
    assert os.stat(run / SIMULATION_FILE).st_mode & 0o777 == 0o600 and marker["note"] == SIMULATION_NOTE
    ledger = json.loads((run / "ledger.json").read_text())
    assert any(note.startswith(SIMULATION_NOTE) for note in ledger["not_covered"])
    # Same steps, noise scaled by b/B (calibration never goes below it, within its tolerance).
    assert marker["target_batch_size"] == 128 and marker["steps"] == ledger["planned_steps"] == 4
    scaled = marker["target_noise_multiplier"] * 32 / 128
    assert scaled <= ledger["noise_multiplier"] <= scaled * 1.002
    # Its epsilon is what its own sigma, q = b/N and T spend: far above the target it simulates.
    spend = (
        dp_accounting.rdp.RdpAccountant()
        .compose(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(
                    32 / 600, dp_accounting.GaussianDpEvent(ledger["noise_multiplier"])
                ),
                4,
            )
        )
        .get_epsilon(1e-5)
    )
    assert ledger["epsilon_spent"] == pytest.approx(spend, rel=1.1e-3) and spend > 2.0  # truncation costs <= 0.1%
    privacy = json.loads((out / sweep.PRIVACY_JSON).read_text())
    assert privacy["runs"][0]["simulated"] and privacy["composed_epsilon"] == pytest.approx(
        ledger["epsilon_spent"], rel=1e-6
    )
    assert any(SIMULATION_NOTE in n for n in privacy["not_covered"])
    assert not result.covered_by_epsilon and any(SIMULATION_NOTE in w for w in result.warnings)
    assert result.simulation["note"] == SIMULATION_NOTE and result.simulation["runs"][0]["epsilon"] == pytest.approx(
        ledger["epsilon_spent"], rel=1e-9
    )
    assert not (out / sweep.SUMMARY_MD).exists() and (out / "summary.NOT-PRIVATE.md").exists()
    with pytest.raises(InvalidConfigError, match="must be below the batch size"):
        sweep.run(_config(features, tmp_path / "s2", simulate_batch=128))


def test_every_file_of_a_simulated_run_names_the_simulation_and_no_command_passes_it_off(features, tmp_path):
    out = tmp_path / "sweep"
    sweep.run(_config(features, out, simulate_batch=32))
    (name,) = os.listdir(out / "runs")
    run = out / "runs" / name
    evaluate.run(evaluate.EvaluateConfig(run_dir=str(run)))  # a later evaluation too
    assert name.startswith("sim-b32-") and name.endswith(".NOT-PRIVATE")  # so every path under it names it
    for path in _files(run):
        if path.startswith(("checkpoints/", "params/")) or path == SIMULATION_FILE:  # orbax's; the marker itself
            continue
        if path.endswith(".json"):
            payload = json.loads((run / path).read_text())
            assert payload["simulated"] is True and SIMULATION_NOTE in payload["simulation"], path
        elif path.endswith(".jsonl"):
            lines = [json.loads(line) for line in (run / path).read_text().splitlines()]
            assert lines and all(line["simulated"] is True for line in lines), path
        else:
            assert path in ("key.id", "run.lock"), path  # not dpscale's JSON: the path names it
    assert {"config.json", "ledger.json", "metrics.json", "metrics.jsonl", "params.sha256.json"} <= set(_files(run))
    ledger = json.loads((run / "ledger.json").read_text())
    assert ledger["private"] is True and ledger["simulated"] is True  # DP at its own epsilon, and a simulation
    reader = RunDirectory.existing(str(run))
    assert reader.read_spec().plan.batch_size == 32 and reader.load_params()  # the stamps do not get in the way
    scores = evaluate.run(evaluate.EvaluateConfig(run_dir=str(run)))
    assert scores.simulated and any(SIMULATION_NOTE in w for w in scores.warnings)
    from dpscale.stages import export_backbone

    with pytest.raises(DataError, match="is a TAN simulation"):
        export_backbone.run(export_backbone.ExportBackboneConfig(run_dir=str(run), output_dir=str(tmp_path / "bb")))
    # A sweep never takes a simulation for a private run of the same name (or the other way round).
    real = out / "runs" / name.replace(".NOT-PRIVATE", "").replace("sim-b32-", "")
    shutil.copytree(run, real)
    with pytest.raises(DataError, match="is a TAN simulation, unlike this sweep's run"):
        sweep.run(_config(features, out))
    # An ordinary run's files carry no such mark.
    plain = tmp_path / "plain"
    sweep.run(_config(features, plain))
    assert "simulated" not in (plain / "runs" / "eps2-lr4-r0" / "ledger.json").read_text()
    assert not evaluate.run(evaluate.EvaluateConfig(run_dir=str(plain / "runs" / "eps2-lr4-r0"))).simulated


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(grid=(("seed", (1, 2)),)), "not a grid option"),
        (dict(grid=(("augmentation", (1, 2)),)), "not a training option"),
        (dict(grid=(("augmult", (1, 4)),)), "does not apply to features mode"),
        (dict(grid=(("epsilon", (1.0,)),)), "epsilons and learning_rates"),
        (dict(training=dict(holdout=100)), "private-diagnostics"),
        (dict(training=dict(steps=None)), "--batch-size and --steps"),
    ],
)
def test_bad_sweeps_are_refused_before_anything_is_written(features, tmp_path, overrides, match):
    with pytest.raises(InvalidConfigError, match=match):
        sweep.run(_config(features, tmp_path / "sweep", **overrides))
    assert not (tmp_path / "sweep").exists()


def test_a_gridded_batch_size_needs_no_flag_and_the_baseline_runs_once_per_value(features, tmp_path):
    """--grid batch-size=... with --baseline used to be refused both with --batch-size and without it."""
    from click.testing import CliRunner

    from dpscale.cli import cli

    out = tmp_path / "sweep"
    result = CliRunner().invoke(
        cli,
        [
            "sweep",
            features,
            str(out),
            "--epsilons",
            "2",
            "--learning-rates",
            "4",
            "--grid",
            "batch-size=64,128",
            "--steps",
            "4",
            "--microbatch-size",
            "64",
            "--repeats",
            "1",
            "--baseline",
            "--accountant",
            "rdp",
        ],
    )
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(out / "runs")) == ["eps2-lr4-batch-size128-r0", "eps2-lr4-batch-size64-r0"]
    assert sorted(os.listdir(out / sweep.BASELINE_DIR / "runs")) == [
        "nonprivate-lr0.5-batch-size128-r0",
        "nonprivate-lr0.5-batch-size64-r0",
    ]
    # the baseline is drawn beside the DP runs only in its own owner-only plot
    plot = out / sweep.BASELINE_DIR / "accuracy_vs_epsilon.NOT-PRIVATE.png"
    assert plot.stat().st_size > 1000 and os.stat(plot).st_mode & 0o777 == 0o600
    # every run's progress says which run of how many it is, and the grid point; the end names the tables
    err = result.stderr
    assert "sweep run 1 of 4 (eps2-lr4-batch-size64-r0) | train: 4/4" in err, err
    assert re.search(r"sweep run 4 of 4 \(nonprivate-lr0\.5-batch-size128-r0; sweep ~\d+:\d\d left\) \| train", err)
    assert "sweep finished: 4 runs (4 trained, 0 reused)" in err
    assert f"the results: {out / sweep.SUMMARY_MD} (median and min-max per setting)" in err
    line = json.loads(result.stdout)
    assert line["runs_trained"] == 4 and str(out / sweep.PLOT) in line["files"] and "baseline" not in line


def test_the_help_names_every_file_a_sweep_writes():
    from click.testing import CliRunner

    from dpscale.cli import cli
    from dpscale.training import release, sweep_report

    text = " ".join(CliRunner().invoke(cli, ["sweep", "--help"]).output.split())
    for name in sweep_report.TABLES:
        assert release.diagnostic_name(name) in text, name  # held-out and simulated sweeps
        assert name in text or name == sweep_report.CHOSEN_CSV, name  # a choice is made on held-out rows only
    for name in (sweep.PRIVACY_JSON, sweep.RECORD, f"{sweep.RUNS}/", f"{sweep.BASELINE_DIR}/"):
        assert name in text, name
    for name in ("chosen/NAME/", "chosen/NAME.json", f"{SELECTION_DIR}/"):  # a private selection's
        assert name in text, name
