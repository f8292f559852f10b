"""The epsilon and calibrate commands: contract, JSON fields, one-line errors."""

import json
import re
import time

import dp_accounting
import pytest
from click.testing import CliRunner

from dpscale.cli import cli
from dpscale.errors import InfeasiblePrivacyTargetError, InvalidConfigError
from dpscale.privacy.accounting import Truncation, epsilon
from dpscale.privacy.plan import PrivacyPlan, PrivacyTarget
from dpscale.stages.calibrate import CalibrateConfig
from dpscale.stages.calibrate import run as run_calibrate
from dpscale.stages.epsilon import EpsilonConfig
from dpscale.stages.epsilon import run as run_epsilon


def _eps(sigma, q, steps, accountant, capacity=None):
    """Epsilon of untruncated Poisson sampling, or truncated to ``capacity`` (of SMALL's N)."""
    truncation = None if capacity is None else Truncation(SMALL["num_examples"], capacity)
    return epsilon(
        noise_multiplier=sigma, sampling_rate=q, steps=steps, delta=1e-5, accountant=accountant, truncation=truncation
    )


SMALL = dict(num_examples=50_000, delta=1e-5)


def _said(err: str) -> list[str]:
    """stderr's lines but the dated one the command starts with (what it is loading and computing)."""
    return [line for line in err.strip().splitlines() if not re.match(r"\d\d:\d\d:\d\d ", line)]


def _invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


# --- stages -----------------------------------------------------------------------


def test_run_epsilon_matches_dp_accounting():
    result = run_epsilon(EpsilonConfig(noise_multiplier=1.2, steps=3000, batch_size=500, accountant="rdp", **SMALL))
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.2)), 3000
    )
    reference = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
    # Batches truncated at the rule's capacity: at most ~0.1% above untruncated Poisson sampling.
    assert reference <= result.epsilon <= reference * 1.002
    assert result.sampling_rate == 0.01 and result.exact and result.warnings == ()
    assert result.batch_capacity > 500


def test_run_epsilon_with_a_ledgers_capacity_equals_the_runs_epsilon():
    plan = PrivacyPlan.calibrate(PrivacyTarget(2.0, 1e-5), num_examples=50_000, batch_size=500, steps=1000)
    result = run_epsilon(
        EpsilonConfig(
            noise_multiplier=plan.noise_multiplier,
            steps=1000,
            batch_size=500,
            batch_capacity=plan.ledger(steps_done=1000).batch_capacity,
            **SMALL,
        )
    )
    assert result.epsilon == plan.epsilon() and result.batch_capacity == plan.batch_capacity
    out = _invoke(
        "epsilon",
        "--noise-multiplier",
        str(plan.noise_multiplier),
        "--steps",
        "1000",
        "--batch-size",
        "500",
        "--num-examples",
        "50000",
        "--delta",
        "1e-5",
        "--batch-capacity",
        str(plan.batch_capacity),
        "--json",
    )
    assert out.exit_code == 0 and json.loads(out.stdout)["epsilon"] == plan.epsilon()


def test_a_capacity_below_the_batch_size_is_refused_not_understated(capfd):
    """The review's case: N = 1,430, B = 128, capacity 100 gave 38.991 (the N + 1 neighbour), below the 39.014
    of the N - 1 neighbour; a capacity below B is refused in one line, and from B up N + 1 is the worse one."""
    case = dict(noise_multiplier=1.0, steps=200, batch_size=128, num_examples=1430, delta=1e-5)
    with pytest.raises(InvalidConfigError, match="batch capacity 100 is below the expected batch size 128"):
        run_epsilon(EpsilonConfig(batch_capacity=100, **case))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "epsilon",
                "--noise-multiplier",
                "1",
                "--steps",
                "200",
                "--batch-size",
                "128",
                "--num-examples",
                "1430",
                "--delta",
                "1e-5",
                "--batch-capacity",
                "100",
            ],
            prog_name="dpscale",
        )
    out, err = capfd.readouterr()
    assert exit_info.value.code == 2 and out == "" and len(_said(err)) == 1
    assert "below the expected batch size" in err
    # What the refusal prevents: below B the accounted pair (N, N + 1) is not the worse one.
    event = lambda size: dp_accounting.SelfComposedDpEvent(  # noqa: E731
        dp_accounting.TruncatedSubsampledGaussianDpEvent(size, 128 / 1430, 100, 1.0), 200
    )
    at_n, at_n1 = (
        dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        .compose(event(size))
        .get_epsilon(1e-5)
        for size in (1430, 1431)
    )
    assert round(at_n, 3) == 39.014 and round(at_n1, 3) == 38.991


def test_shuffled_sampling_result_is_flagged_and_warned():
    result = run_epsilon(
        EpsilonConfig(noise_multiplier=1.2, steps=100, batch_size=500, accountant="rdp", sampling="shuffle", **SMALL)
    )
    assert not result.exact
    assert any("shuffle" in w for w in result.warnings)


@pytest.mark.parametrize("solve_for", ["noise_multiplier", "steps", "batch_size"])
def test_run_calibrate_solves_the_missing_knob_without_overshoot(solve_for):
    knobs = dict(noise_multiplier=1.1, steps=2000, batch_size=512)
    knobs[solve_for] = None
    result = run_calibrate(CalibrateConfig(epsilon=3.0, accountant="rdp", **SMALL, **knobs))
    assert result.solved_for == solve_for
    for name, value in knobs.items():
        if value is not None:
            assert getattr(result, name) == value  # the given knobs are untouched
    q = result.batch_size / SMALL["num_examples"]
    assert result.epsilon == _eps(result.noise_multiplier, q, result.steps, "rdp", result.batch_capacity) <= 3.0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(epsilon=1.0, batch_size=10),  # two unknowns
        dict(epsilon=1.0),  # three unknowns
        dict(epsilon=1.0, batch_size=10, steps=10, noise_multiplier=1.0),  # none unknown
        dict(epsilon=0.0, batch_size=10, steps=10),
        dict(epsilon=1.0, batch_size=0, steps=10),
        dict(epsilon=1.0, batch_size=10, steps=-3),
        dict(epsilon=1.0, batch_size=10, noise_multiplier=-1.0),
        dict(epsilon=1.0, batch_size=50_001, steps=10),  # q > 1
        dict(epsilon=1.0, batch_size=10, steps=10, accountant="moments"),
    ],
)
def test_bad_calibrate_configs_are_rejected(kwargs):
    with pytest.raises(InvalidConfigError):
        CalibrateConfig(**SMALL, **kwargs)


def test_delta_not_below_one_over_n_warns():
    result = run_epsilon(
        EpsilonConfig(noise_multiplier=2.0, steps=10, batch_size=10, num_examples=1000, delta=1e-3, accountant="rdp")
    )
    assert any("1/num_examples" in w for w in result.warnings)


def test_impossible_target_raises():
    with pytest.raises(InfeasiblePrivacyTargetError):
        run_calibrate(
            CalibrateConfig(epsilon=0.001, noise_multiplier=0.5, batch_size=25_000, accountant="rdp", **SMALL)
        )


# --- CLI --------------------------------------------------------------------------

EPSILON_ARGS = [
    "epsilon",
    "--noise-multiplier",
    "1.2",
    "--steps",
    "3000",
    "--batch-size",
    "500",
    "--num-examples",
    "50000",
    "--delta",
    "1e-5",
]


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_cli_epsilon_json(accountant):
    result = _invoke(*EPSILON_ARGS, "--accountant", accountant, "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    untruncated = _eps(1.2, 0.01, 3000, accountant)
    assert untruncated <= payload["epsilon"] <= untruncated * 1.002  # truncated at the rule's capacity
    assert payload["delta"] == 1e-5 and payload["accountant"] == accountant
    assert payload["noise_multiplier"] == 1.2 and payload["steps"] == 3000
    assert payload["batch_size"] == 500 and payload["num_examples"] == 50000
    assert payload["sampling_rate"] == 0.01


def test_cli_epsilon_text_defaults_to_pld():
    result = _invoke(*EPSILON_ARGS)
    assert result.exit_code == 0
    capacity = int(re.search(r"truncated to (\d+)", result.stdout).group(1))
    assert f"{_eps(1.2, 0.01, 3000, 'pld', capacity):.6g}" in result.stdout and "PLD" in result.stdout


@pytest.mark.parametrize(
    "given,solved",
    [
        (["--batch-size", "500", "--steps", "3000"], "noise_multiplier"),
        (["--batch-size", "500", "--noise-multiplier", "1.2"], "steps"),
        (["--steps", "3000", "--noise-multiplier", "1.2"], "batch_size"),
    ],
)
def test_cli_calibrate_json(given, solved):
    result = _invoke(
        "calibrate",
        "--epsilon",
        "2",
        "--delta",
        "1e-5",
        "--num-examples",
        "50000",
        "--accountant",
        "rdp",
        "--json",
        *given,
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    for key in ("noise_multiplier", "steps", "batch_size", "epsilon", "delta", "accountant"):
        assert key in payload
    assert payload["solved_for"] == solved and payload["accountant"] == "rdp"
    assert payload["epsilon"] <= 2.0
    q = payload["batch_size"] / 50000
    assert payload["epsilon"] == _eps(
        payload["noise_multiplier"], q, payload["steps"], "rdp", payload["batch_capacity"]
    )


BAD_CALIBRATIONS = {
    "infeasible": [
        "--epsilon",
        "0.001",
        "--delta",
        "1e-5",
        "--num-examples",
        "1000",
        "--batch-size",
        "500",
        "--noise-multiplier",
        "0.5",
    ],
    "q > 1": ["--epsilon", "1", "--delta", "1e-5", "--num-examples", "100", "--batch-size", "500", "--steps", "10"],
    "two unknowns": ["--epsilon", "1", "--delta", "1e-5", "--num-examples", "100", "--batch-size", "50"],
    "zero unknowns": [
        "--epsilon",
        "1",
        "--delta",
        "1e-5",
        "--num-examples",
        "100",
        "--batch-size",
        "5",
        "--steps",
        "3",
        "--noise-multiplier",
        "1",
    ],
    "negative epsilon": [
        "--epsilon",
        "-1",
        "--delta",
        "1e-5",
        "--num-examples",
        "100",
        "--batch-size",
        "5",
        "--steps",
        "3",
    ],
    "zero delta": ["--epsilon", "1", "--delta", "0", "--num-examples", "100", "--batch-size", "5", "--steps", "3"],
    "zero examples": ["--epsilon", "1", "--delta", "1e-5", "--num-examples", "0", "--batch-size", "5", "--steps", "3"],
    "bad accountant": [
        "--epsilon",
        "1",
        "--delta",
        "1e-5",
        "--num-examples",
        "100",
        "--batch-size",
        "5",
        "--steps",
        "3",
        "--accountant",
        "gdp",
    ],
}


@pytest.mark.parametrize("case", sorted(BAD_CALIBRATIONS))
def test_cli_calibrate_errors_are_one_line_with_exit_code_2(case, capfd):
    # The group exits itself (sys.exit), so run it like the console script does.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["calibrate", "--accountant", "rdp", *BAD_CALIBRATIONS[case]], prog_name="dpscale")
    out, err = capfd.readouterr()
    assert exit_info.value.code == 2
    assert out == ""
    lines = _said(err)
    assert len(lines) == 1 and lines[0].startswith("dpscale: error: "), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "bad", [["--noise-multiplier", "0"], ["--batch-size", "60000"], ["--steps", "0"], ["--delta", "1.5"]]
)
def test_cli_epsilon_errors_are_one_line_with_exit_code_2(bad, capfd):
    args = list(EPSILON_ARGS)
    flag = args.index(bad[0])
    args[flag + 1] = bad[1]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args, prog_name="dpscale")
    _, err = capfd.readouterr()
    assert exit_info.value.code == 2
    assert len(_said(err)) == 1 and "Traceback" not in err


def test_cli_warns_on_stderr_when_delta_is_not_below_one_over_n(capfd):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "epsilon",
                "--noise-multiplier",
                "2",
                "--steps",
                "10",
                "--batch-size",
                "10",
                "--num-examples",
                "1000",
                "--delta",
                "0.001",
                "--json",
            ],
            prog_name="dpscale",
        )
    out, err = capfd.readouterr()
    assert exit_info.value.code == 0
    assert "warning" in err and "1/num_examples" in err
    assert json.loads(out)["delta"] == 0.001  # stdout stays pure JSON


def test_cli_calibrate_keeps_rdp_convergence_chatter_out_of_the_output(capfd):
    # sigma = 1 at q = 0.136 makes dp-accounting log "failed to converge" warnings.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "calibrate",
                "--epsilon",
                "8",
                "--delta",
                "1e-4",
                "--num-examples",
                "1000",
                "--noise-multiplier",
                "1",
                "--steps",
                "100",
                "--accountant",
                "rdp",
            ],
            prog_name="dpscale",
        )
    out, err = capfd.readouterr()
    assert exit_info.value.code == 0
    assert "converge" not in out + err and _said(err) == []


@pytest.mark.parametrize("command", ["epsilon", "calibrate"])
def test_cli_help_explains_the_command(command):
    result = _invoke(command, "--help")
    assert result.exit_code == 0
    for flag in (
        "--noise-multiplier",
        "--steps",
        "--batch-size",
        "--num-examples",
        "--delta",
        "--accountant",
        "--json",
    ):
        assert flag in result.output
    assert "Example" in result.output


def test_a_calibration_that_takes_a_while_says_so_on_stderr(capsys, monkeypatch):
    """`dpscale calibrate` ran for 100 s without a word (issue 50); a search past a few seconds now says what it is."""
    from dpscale import progress
    from dpscale.stages import calibrate

    monkeypatch.setattr(progress, "STATUS_AFTER_SECONDS", 0.05)
    real = PrivacyPlan.calibrate
    monkeypatch.setattr(calibrate.PrivacyPlan, "calibrate", lambda *a, **k: time.sleep(0.5) or real(*a, **k))
    run_calibrate(CalibrateConfig(epsilon=3.0, accountant="rdp", noise_multiplier=1.1, steps=2000, **SMALL))
    err = capsys.readouterr().err
    assert re.search(
        r"\d\d:\d\d:\d\d calibrate: solving for the batch size \(RDP accountant\) \.\.\., 0:00 elapsed", err
    )
    run_calibrate(
        CalibrateConfig(epsilon=3.0, accountant="rdp", noise_multiplier=1.1, steps=2000, **SMALL, show_progress=False)
    )
    assert capsys.readouterr().err == ""


# --- a private selection ------------------------------------------------------------


def test_cli_epsilon_and_calibrate_answer_for_a_private_selection():
    """The selection's epsilon (RDP, repetitions and scores in) heads the JSON; one run's alone is beside it."""
    from dpscale.privacy.repetitions import Repetitions
    from dpscale.privacy.selection import Selection, SelectionPlan

    args = ["--num-examples", "50000", "--batch-size", "5000", "--steps", "200", "--delta", "1e-5", "--json"]
    selection = ["--private-selection", "--repetitions", "poisson", "--repetitions-mean", "5", "--score-noise", "20"]
    calibrated = json.loads(_invoke("calibrate", "--epsilon", "2", *args, *selection).stdout)
    assert calibrated["epsilon"] <= 2 and calibrated["accountant"] == calibrated["epsilon_bound"] == "rdp"
    report = calibrated["private_selection"]
    assert report["epsilon"] == calibrated["epsilon"] and report["run_epsilon"] < calibrated["epsilon"]
    assert report["repetitions"] == {"distribution": "poisson", "mean": 5.0, "shape": 1.0}
    sigma, capacity = calibrated["noise_multiplier"], calibrated["batch_capacity"]
    spent = json.loads(
        _invoke(
            "epsilon", "--noise-multiplier", repr(sigma), "--batch-capacity", str(capacity), *args, *selection
        ).stdout
    )
    assert spent["epsilon"] == calibrated["epsilon"]  # the run the calibration planned, accounted again
    plan = PrivacyPlan(
        num_examples=50000, batch_size=5000, steps=200, noise_multiplier=sigma, delta=1e-5, batch_capacity=capacity
    )
    assert spent["epsilon"] == SelectionPlan(plan, Selection(Repetitions("poisson", 5.0), 20.0)).epsilon()
    plain = json.loads(_invoke("calibrate", "--epsilon", "2", *args).stdout)
    assert plain["noise_multiplier"] < sigma  # one run alone needs less noise than the best of several


def test_selection_flags_without_private_selection_are_refused(capfd):
    result = CliRunner().invoke(
        cli,
        [
            "epsilon",
            "--noise-multiplier",
            "2",
            "--steps",
            "10",
            "--batch-size",
            "10",
            "--num-examples",
            "100",
            "--repetitions-mean",
            "4",
        ],
    )
    assert result.exit_code == 2 and "--repetitions-mean: only with --private-selection" in result.stderr
