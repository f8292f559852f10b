"""What a DP step costs against a non-private one, through ``dpscale train`` itself (run by hand, alone).

    python -m benchmarks.dp_step_cost DATA                  # the four settings below, 2 repeats
    python -m benchmarks.dp_step_cost DATA --settings cnn-small:256:1 --steps 40

DATA is an ingested image dataset (e.g. CIFAR-10). For each setting (model, micro-batch,
augmult K) the benchmark runs ``dpscale train`` at epsilon 8 and at ``--epsilon inf``, one
after the other, ``--repeats`` times, each in a fresh process with the same seed: both draw
the same Poisson batches (same N, B and sampling stream), so step t has the same number of
micro-batches in both and the ratio is taken step by step. Per-step wall times are read from
the run's own per-step records; the first ``--warmup`` steps (compilation) are dropped. Peak
memory is the process's maximum resident set (GNU time). The load average is printed before
and after: a timing is only worth something when nothing else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = ("cnn-small:256:1", "cnn-small:256:4", "wrn-16-4:64:1", "wrn-16-4:64:4")


def _per_step_seconds(run_dir: Path) -> dict[int, float]:
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


def _train(data: str, run_dir: Path, *, model: str, microbatch: int, views: int, batch: int, steps: int,
           epsilon: str) -> tuple[dict[int, float], int]:
    """Per-step seconds and peak RSS (kB) of one ``dpscale train`` process."""
    rss_file = run_dir.parent / f"{run_dir.name}.rss"
    command = ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), sys.executable, "-m", "dpscale", "train", data,
               str(run_dir), "--model", model, "--epsilon", epsilon, "--batch-size", str(batch),
               "--microbatch-size", str(microbatch), "--augmult", str(views), "--steps", str(steps),
               "--checkpoint-every", str(steps + 1), "--seed", "0", "--private-diagnostics"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"dpscale train failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return _per_step_seconds(run_dir), int(rss_file.read_text().split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="model:microbatch:K, comma-separated")
    parser.add_argument("--batch-multiple", type=int, default=1, help="expected batch B = this x micro-batch")
    parser.add_argument("--steps", type=int, default=30, help="at least 22: the step after an epsilon log is dropped")
    parser.add_argument("--warmup", type=int, default=3, help="first steps dropped (compilation)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None, help="append one JSON line per setting here")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for setting in args.settings.split(","):
            model, microbatch, views = setting.split(":")
            microbatch, views = int(microbatch), int(views)
            times: dict[str, list[dict[int, float]]] = {"dp": [], "nonprivate": []}
            rss: dict[str, list[int]] = {"dp": [], "nonprivate": []}
            for repeat in range(args.repeats):
                for kind, epsilon in (("dp", "8"), ("nonprivate", "inf")):
                    run = Path(tmp) / f"{model}-{microbatch}-{views}-{kind}-{repeat}"
                    per_step, peak = _train(args.data, run, model=model, microbatch=microbatch, views=views,
                                            batch=args.batch_multiple * microbatch, steps=args.steps,
                                            epsilon=epsilon)
                    times[kind].append({t: s for t, s in per_step.items() if t > args.warmup})
                    rss[kind].append(peak)
            ratios = [dp[t] / nonprivate[t] for dp, nonprivate in zip(times["dp"], times["nonprivate"])
                      for t in dp if t in nonprivate]
            if len(ratios) < 2:
                raise SystemExit(f"{setting}: {len(ratios)} usable steps; training logs epsilon every "
                                 f"ceil(steps / 20) steps and the step after a log is dropped: use --steps 22 or more")
            row = {
                "setting": setting, "batch": args.batch_multiple * microbatch,
                "dp_step_s": statistics.median(s for run in times["dp"] for s in run.values()),
                "nonprivate_step_s": statistics.median(s for run in times["nonprivate"] for s in run.values()),
                "ratio_median": statistics.median(ratios), "ratio_q1_q3": statistics.quantiles(ratios, n=4)[::2],
                "pairs": len(ratios), "dp_peak_mb": max(rss["dp"]) / 1024,
                "nonprivate_peak_mb": max(rss["nonprivate"]) / 1024,
            }
            row["memory_ratio"] = row["dp_peak_mb"] / row["nonprivate_peak_mb"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps(row) + "\n")
    print(f"load average after: {os.getloadavg()}")
    print("| setting | batch | DP s/step | non-private s/step | DP / non-private (median; q1-q3) | peak MB DP / non-private |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        q1, q3 = r["ratio_q1_q3"]
        print(f"| {r['setting']} | {r['batch']} | {r['dp_step_s']:.3f} | {r['nonprivate_step_s']:.3f} | "
              f"**{r['ratio_median']:.2f}** ({q1:.2f}-{q3:.2f}, {r['pairs']} steps) | "
              f"{r['dp_peak_mb']:,.0f} / {r['nonprivate_peak_mb']:,.0f} ({r['memory_ratio']:.2f}x) |")


if __name__ == "__main__":
    main()
