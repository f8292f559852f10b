"""Audit DP-SGD at nominal epsilon 1, 2, 4, 8 and write a report (``--out``) of every row.

Usage (Fashion-MNIST ingested first):
    apt-get install -y dataset-fashion-mnist
    dpscale ingest idx:/usr/share/datasets/fashion-mnist /tmp/audit_data/fmnist
    python -m benchmarks.audit /tmp/audit_data/fmnist --num-models 2000

Every row must have its lower bound at or below the nominal epsilon; the script
exits with status 1 (and says so in the report) if one does not. The figures that stand go, with this
command and the commit, into the table at the top of ``benchmarks/results/audit.md``.
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

from dpscale.audit.game import markdown_table
from dpscale.stages import audit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("--num-models", type=int, default=2000)
    parser.add_argument("--num-examples", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--learning-rate", type=float, default=1.0)
    parser.add_argument("--model", default="linear")
    parser.add_argument("--canary", default="ood")
    parser.add_argument("--one-run-canaries", type=int, default=0)
    parser.add_argument("--epsilons", default="1,2,4,8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="Fashion-MNIST")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "dpscale-benchmarks", "audit.md"))
    args = parser.parse_args()

    config = audit.AuditConfig(
        data=args.data,
        epsilons=tuple(float(e) for e in args.epsilons.split(",")),
        num_examples=args.num_examples,
        batch_size=args.batch_size,
        steps=args.steps,
        learning_rate=args.learning_rate,
        model=args.model,
        canary=args.canary,
        num_models=args.num_models,
        one_run_canaries=args.one_run_canaries,
        seed=args.seed,
    )
    started = time.perf_counter()
    result = audit.run(config)
    wall = time.perf_counter() - started
    violations = [r for r in result.rows if r["violation"]]
    command = "python " + " ".join(sys.argv)
    lines = [
        f"## {args.label}: |D|={args.num_examples}, {args.model}, canary={args.canary}\n",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs (shared), jax {jax.__version__}, "
        f"{jax.device_count()} host devices.  ",
        f"Expected batch B={args.batch_size} (Poisson, q={args.batch_size / args.num_examples:g}), "
        f"T={args.steps} steps, SGD lr={args.learning_rate}, clip C=1, delta={config.delta:g}, "
        f"{args.num_models} models per row (half with the canary; threshold chosen on "
        f"{config.holdout_fraction:.0%} of them), Clopper-Pearson at {config.confidence:.1%}, "
        f"seed {result.seed}. Total wall time {wall:.0f} s.\n",
        markdown_table(result.rows),
        (
            "**VIOLATION: a lower bound exceeds its nominal epsilon: a bug to investigate.**\n"
            if violations
            else "All lower bounds are at or below the nominal epsilon.\n"
        ),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "a") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(result.as_dict() | {"command": command, "wall_seconds": wall}, f, indent=2)
    sys.exit(1 if violations else 0)


if __name__ == "__main__":
    main()
