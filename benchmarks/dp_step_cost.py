"""What a DP step costs against a non-private one, through ``dpscale train`` itself (run by hand, alone).

    python -m benchmarks.dp_step_cost DATA                  # the four settings below, 2 repeats
    python -m benchmarks.dp_step_cost DATA --settings cnn-small:256:1 --steps 40
    python -m benchmarks.dp_step_cost DATA --settings wrn-16-4:64:1 --out new.jsonl --compare-to old.jsonl

DATA is an ingested image dataset (e.g. CIFAR-10). For each setting (model, micro-batch,
augmult K) the benchmark runs ``dpscale train`` at epsilon 8 and at ``--epsilon inf``, one
after the other, ``--repeats`` times, each in a fresh process with the same seed: both draw
the same Poisson batches (same N, B and sampling stream), so step t is compared with step t.
Per-step wall times are read from the run's own per-step records; the first ``--warmup`` steps
(compilation) are dropped. Peak memory is the process's maximum resident set (GNU time).

Each step's own seconds are reported, DP and non-private, beside their ratio: a ratio alone
hides a step that got slower on both sides, or a non-private step that got slower (which makes
DP look cheap). ``--compare-to`` sets them against an earlier ``--out`` file, setting by
setting, and flags a step that got slower. Every row records the commit, seed, load averages
and ``XLA_FLAGS`` it was measured under: a timing is only worth something when nothing else runs.

On a shared machine, ``--xla-cost`` adds what does not depend on the load: XLA's cost analysis of
the micro-batch program each kind of run compiles (the trainer's own accumulate, at its layout),
times the number of micro-batches a step runs. A program or layout that changed shows there. XLA
counts a loop's body once, whatever its trip count, and the DP program runs its per-example work in
loops (chunks of examples): its flops and bytes are lower bounds, to compare with the same program's
at another commit, not with the non-private program's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = ("cnn-small:256:1", "cnn-small:256:4", "wrn-16-4:64:1", "wrn-16-4:64:4")
KINDS = (("dp", "8"), ("nonprivate", "inf"))


def per_step_seconds(run_dir: Path) -> dict[int, float]:
    """Wall time of each step from the run's per-step records (cumulative ``seconds``).

    A step that follows one whose epsilon was logged is left out: the accountant's work for
    the log falls into its interval (about 20 times a run), not into the DP step.
    """
    cumulative: dict[int, float] = {}
    logged: set[int] = set()
    for path in sorted(run_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "seconds" in record and "step" in record:
                cumulative[int(record["step"])] = float(record["seconds"])
            if "epsilon_spent" in record:
                logged.add(int(record["step"]))
    steps = sorted(cumulative)
    return {t: cumulative[t] - cumulative[s] for s, t in zip(steps, steps[1:]) if t == s + 1 and s not in logged}


def _commit() -> str:
    """The commit of the dpscale that ``python -m dpscale`` runs here, ``+dirty`` when its tracked files differ."""
    package = Path(importlib.util.find_spec("dpscale").submodule_search_locations[0])

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode:
        return f"unknown ({package})"
    return head.stdout.strip() + ("+dirty" if git("diff", "--quiet", "HEAD").returncode else "")


def _train(
    data: str,
    run_dir: Path,
    *,
    model: str,
    microbatch: int,
    views: int,
    batch: int,
    steps: int,
    epsilon: str,
    seed: int,
) -> tuple[dict[int, float], int]:
    """Per-step seconds and peak RSS (kB) of one ``dpscale train`` process."""
    rss_file = run_dir.parent / f"{run_dir.name}.rss"
    command = [
        "/usr/bin/time",
        "-f",
        "%M",
        "-o",
        str(rss_file),
        sys.executable,
        "-m",
        "dpscale",
        "train",
        data,
        str(run_dir),
        "--model",
        model,
        "--epsilon",
        epsilon,
        "--batch-size",
        str(batch),
        "--microbatch-size",
        str(microbatch),
        "--augmult",
        str(views),
        "--steps",
        str(steps),
        "--checkpoint-every",
        str(steps + 1),
        "--seed",
        str(seed),
    ]
    if epsilon != "inf":  # per-step times are a DP run's private diagnostic; a non-private run writes them anyway
        command.append("--private-diagnostics")
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"dpscale train failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return per_step_seconds(run_dir), int(rss_file.read_text().split()[-1])


def xla_step_cost(
    data: str, *, model: str, microbatch: int, views: int, batch: int, steps: int, epsilon: str, seed: int
) -> dict:
    """XLA's flops, bytes accessed and temporary memory of one step of a ``dpscale train`` run (no step is run).

    The plan, layout and clipped sum are the trainer's (one device); the micro-batch program is
    ``DpsgdStep.accumulate_traceable`` lowered at the shapes the run's feed produces.
    """
    import jax
    import optax

    from dpscale.training.config import training_config
    from dpscale.training.model import build_train_model
    from dpscale.training.trainer import plan_for

    config = training_config(
        "images",
        epsilon=float(epsilon),
        batch_size=batch,
        steps=steps,
        seed=seed,
        microbatch_size=microbatch,
        model=model,
        augmult=views,
    )
    train_model = build_train_model(data, config)
    plan = plan_for(config, train_model)
    step = plan.dp_step(
        train_model.loss_fn,
        seed=seed,
        clip_norm=config.clip_norm,
        clipped_sum=train_model.clipped_sum_fn,
        optimizer=optax.sgd(config.learning_rate),
        ema_decay=config.ema_decay,
    )
    sampler = plan.sampler(seed=seed, microbatch_size=config.effective_microbatch_size)
    (views_batch, mask), *_ = train_model.make_feed(jax.random.key(seed)).microbatches(sampler.sample(0), 0)
    state = step.init(train_model.init_params(seed), train_model.model_state)
    compiled = (
        jax.jit(step.accumulate_traceable)
        .lower(state.params, step.zero_sum(state), views_batch, mask, state.model_state)
        .compile()
    )
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    count = sampler.layout.num_microbatches
    return {
        "layout": f"{count} x {sampler.layout.microbatch_size}",
        "gflops": count * analysis["flops"] / 1e9,
        "gbytes_accessed": count * analysis["bytes accessed"] / 1e9,
        "temp_mb": compiled.memory_analysis().temp_size_in_bytes / 2**20,
    }


def summarize(setting: str, batch: int, times: dict[str, list[dict[int, float]]], rss: dict[str, list[int]]) -> dict:
    """One setting's row: each step's own seconds (all runs pooled, and per run), the step-by-step ratio, memory.

    ``times[kind]`` holds one ``{step: seconds}`` per run, warm-up already dropped; DP run r is
    paired with non-private run r, step t with step t.
    """
    ratios = [
        dp[t] / nonprivate[t] for dp, nonprivate in zip(times["dp"], times["nonprivate"]) for t in dp if t in nonprivate
    ]
    if len(ratios) < 2:
        raise SystemExit(
            f"{setting}: {len(ratios)} usable steps; training logs epsilon every "
            f"ceil(steps / 20) steps and the step after a log is dropped: use --steps 22 or more"
        )
    row = {"setting": setting, "batch": batch}
    for kind, _ in KINDS:
        row[f"{kind}_step_s"] = statistics.median(s for run in times[kind] for s in run.values())
        row[f"{kind}_runs_s"] = [round(statistics.median(run.values()), 3) for run in times[kind]]
    row.update(
        {
            "ratio_median": statistics.median(ratios),
            "ratio_q1_q3": statistics.quantiles(ratios, n=4)[::2],
            "pairs": len(ratios),
            "dp_peak_mb": max(rss["dp"]) / 1024,
            "nonprivate_peak_mb": max(rss["nonprivate"]) / 1024,
        }
    )
    row["memory_ratio"] = row["dp_peak_mb"] / row["nonprivate_peak_mb"]
    return row


def compare(row: dict, earlier: list[dict], *, tolerance: float) -> list[str]:
    """Lines setting ``row``'s per-step seconds against the latest earlier row of the same setting and batch.

    A step more than ``tolerance`` (a fraction) slower than before is flagged SLOWER; which of
    the two got slower is the point (a ratio can stay put while both move).
    """
    same = [r for r in earlier if r.get("setting") == row["setting"] and r.get("batch") == row["batch"]]
    if not same:
        return [f"{row['setting']} B={row['batch']}: nothing earlier to compare with"]
    then = same[-1]
    lines = []
    for kind, _ in KINDS:
        key = f"{kind}_step_s"
        factor = row[key] / then[key]
        flag = "  SLOWER" if factor > 1 + tolerance else ""
        lines.append(
            f"{row['setting']} B={row['batch']} {kind}: {row[key]:.3f} s/step now, {then[key]:.3f} at "
            f"{then.get('commit', '?')} (load {then.get('load_before', '?')}): x{factor:.2f}{flag}"
        )
    return lines


def _read_rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _load1() -> float:
    return round(os.getloadavg()[0], 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="model:microbatch:K, comma-separated")
    parser.add_argument("--batch-multiple", type=int, default=1, help="expected batch B = this x micro-batch")
    parser.add_argument("--steps", type=int, default=30, help="at least 22: the step after an epsilon log is dropped")
    parser.add_argument("--warmup", type=int, default=3, help="first steps dropped (compilation)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the runs' --seed (both kinds draw the same batches)")
    parser.add_argument("--out", default=None, help="append one JSON line per setting here")
    parser.add_argument("--compare-to", default=None, help="an earlier --out file: flag steps that got slower")
    parser.add_argument("--tolerance", type=float, default=0.2, help="slower by more than this fraction is flagged")
    parser.add_argument("--xla-cost", action="store_true", help="also XLA's cost of each kind's step (load-free)")
    parser.add_argument("--xla-cost-only", action="store_true", help="only that: no training run, no timing")
    args = parser.parse_args()
    earlier = _read_rows(args.compare_to) if args.compare_to else []
    commit = _commit()
    print(f"commit {commit}, load average before: {os.getloadavg()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for setting in args.settings.split(","):
            model, microbatch, views = setting.split(":")
            microbatch, views = int(microbatch), int(views)
            batch = args.batch_multiple * microbatch
            times: dict[str, list[dict[int, float]]] = {kind: [] for kind, _ in KINDS}
            rss: dict[str, list[int]] = {kind: [] for kind, _ in KINDS}
            common = {
                "model": model,
                "microbatch": microbatch,
                "views": views,
                "batch": batch,
                "steps": args.steps,
                "seed": args.seed,
            }
            if args.xla_cost or args.xla_cost_only:
                for kind, epsilon in KINDS:
                    cost = xla_step_cost(args.data, epsilon=epsilon, **common)
                    print(
                        json.dumps({"setting": setting, "batch": batch, "kind": kind, "commit": commit, **cost}),
                        flush=True,
                    )
            if args.xla_cost_only:
                continue
            load_before = _load1()
            for repeat in range(args.repeats):
                for kind, epsilon in KINDS:
                    run = Path(tmp) / f"{model}-{microbatch}-{views}-{kind}-{repeat}"
                    per_step, peak = _train(args.data, run, epsilon=epsilon, **common)
                    times[kind].append({t: s for t, s in per_step.items() if t > args.warmup})
                    rss[kind].append(peak)
            row = summarize(setting, batch, times, rss)
            row.update(
                {
                    "commit": commit,
                    "seed": args.seed,
                    "steps": args.steps,
                    "repeats": args.repeats,
                    "load_before": load_before,
                    "load_after": _load1(),
                    "xla_flags": os.environ.get("XLA_FLAGS", ""),
                }
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps(row) + "\n")
    print(f"load average after: {os.getloadavg()}")
    if not rows:
        return
    print(
        "| setting | batch | DP s/step (runs) | non-private s/step (runs) | DP / non-private (median; q1-q3) "
        "| peak MB DP / non-private | commit, load |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        q1, q3 = r["ratio_q1_q3"]
        runs = {kind: " / ".join(f"{s:.2f}" for s in r[f"{kind}_runs_s"]) for kind, _ in KINDS}
        print(
            f"| {r['setting']} | {r['batch']} | {r['dp_step_s']:.3f} ({runs['dp']}) | "
            f"{r['nonprivate_step_s']:.3f} ({runs['nonprivate']}) | "
            f"**{r['ratio_median']:.2f}** ({q1:.2f}-{q3:.2f}, {r['pairs']} steps) | "
            f"{r['dp_peak_mb']:,.0f} / {r['nonprivate_peak_mb']:,.0f} ({r['memory_ratio']:.2f}x) | "
            f"{r['commit']}, {r['load_before']}-{r['load_after']} |"
        )
    if args.compare_to:
        for r in rows:
            print("\n".join(compare(r, earlier, tolerance=args.tolerance)))


if __name__ == "__main__":
    main()
