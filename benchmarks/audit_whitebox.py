"""Audit rows at nominal epsilon 1, 2, 4, 8, one stage call per row, with its wall time and load.

White-box (the default here) or black-box, on correct code or with a broken step run through
the audit's seam for it (``--bug half-noise``: ``audit.broken_steps.HalfNoise``, half the noise):

    dpscale ingest idx:/usr/share/datasets/fashion-mnist /tmp/fmnist
    python -m benchmarks.audit_whitebox /tmp/fmnist --num-examples 100 --steps 10 --num-models 4000
    python -m benchmarks.audit_whitebox /tmp/fmnist --num-examples 100 --steps 10 --num-models 4000 --bug half-noise

Appends a Markdown section (command, machine, per-row load average) to ``--out`` (default: a scratch
file under the system's temporary directory) and writes the rows as JSON beside it; the figures that
stand go into the table at the top of ``benchmarks/results/audit.md``. Exit status 1 if correct code is flagged, or a bug is not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import jax

from dpscale.audit.broken_steps import HalfNoise
from dpscale.audit.game import markdown_table
from dpscale.privacy.plan import MechanismParts
from dpscale.stages import audit


def _parts(bug: str) -> MechanismParts:
    return MechanismParts(step=HalfNoise) if bug == "half-noise" else MechanismParts()


def _run_rows(args: argparse.Namespace) -> list[dict]:
    rows = []
    for epsilon in (float(e) for e in args.epsilons.split(",")):
        config = audit.AuditConfig(
            data=args.data,
            epsilons=(epsilon,),
            num_examples=args.num_examples,
            batch_size=args.batch_size,
            steps=args.steps,
            model=args.model,
            num_models=args.num_models,
            confidence=args.confidence,
            canary=args.canary,
            seed=args.seed,
            threat_model=args.threat_model,
            microbatches=args.microbatches,
            per_example=args.per_example,
            chunk_size=args.chunk_size,
            show_progress=False,
            devices=args.devices,
            parts=_parts(args.bug),
        )
        before = os.getloadavg()
        started, cpu = time.perf_counter(), time.process_time()
        (row,) = audit.run(config).rows
        row |= {
            "wall_seconds": time.perf_counter() - started,
            "cpu_seconds": time.process_time() - cpu,
            "load_before": before,
            "load_after": os.getloadavg(),
        }
        rows.append(row)
        print(
            json.dumps(
                {
                    k: row[k]
                    for k in (
                        "nominal_epsilon",
                        "best_estimator",
                        "best_lower_bound",
                        "epsilon_lower_bound",
                        "wall_seconds",
                        "load_after",
                    )
                }
            ),
            flush=True,
        )
        print(markdown_table([row]), flush=True)  # a killed run still leaves its finished rows
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("--threat-model", default="white-box", choices=["white-box", "black-box"])
    parser.add_argument("--model", default="linear")
    parser.add_argument("--per-example", default="vmap")
    parser.add_argument("--num-examples", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--num-models", type=int, default=4000)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--canary", default="ood")
    parser.add_argument("--confidence", type=float, default=0.999)
    parser.add_argument("--epsilons", default="1,2,4,8")
    parser.add_argument("--bug", default="none", choices=["none", "half-noise"])
    parser.add_argument("--chunk-size", type=int, default=500)
    parser.add_argument("--devices", type=int, default=1, help="white-box: devices of the sharded step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "dpscale-benchmarks", "audit_runs.md"))
    args = parser.parse_args()
    rows = _run_rows(args)

    flagged = [r["violation"] for r in rows]
    ok = all(flagged) if args.bug != "none" else not any(flagged)
    command = "python " + " ".join(sys.argv)
    load_lines = "\n".join(
        f"- nominal {r['nominal_epsilon']:.3f}: wall {r['wall_seconds']:.0f} s, CPU {r['cpu_seconds']:.0f} s, "
        f"load average (1/5/15 min) before {'/'.join(f'{x:.1f}' for x in r['load_before'])}, after "
        f"{'/'.join(f'{x:.1f}' for x in r['load_after'])}"
        for r in rows
    )
    text = (
        "\n".join(
            [
                f"### {args.threat_model}, {args.model}, |D|={args.num_examples}, bug={args.bug}, devices={args.devices}\n",
                f"Command: `{command}`  ",
                f"Machine: {platform.machine()}, {os.cpu_count()} CPUs (shared), jax {jax.__version__}.\n",
                markdown_table(rows),
                load_lines + "\n",
                (
                    "Outcome: as expected ("
                    + ("every row flagged" if args.bug != "none" else "no row flagged")
                    + ").\n"
                    if ok
                    else "**Outcome: NOT as expected.**\n"
                ),
            ]
        )
        + "\n"
    )
    print(text)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "a") as f:
        f.write(text)
    stem = os.path.splitext(args.out)[0]
    tag = f"{args.threat_model}_{args.model}_{args.num_examples}_{args.bug}_{args.devices}dev"
    with open(f"{stem}_{tag}.json", "w") as f:
        json.dump({"command": command, "rows": rows}, f, indent=2, default=str)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
