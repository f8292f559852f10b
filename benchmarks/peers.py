"""dpscale vs Opacus vs jax-privacy: the same DP-SGD step, side by side (run by hand, alone).

    python -m benchmarks.peers --quick     # a few minutes: CNN + linear 2^14, calibration
    python -m benchmarks.peers             # CNN, WRN-16-4, linear 2^16 and 2^18, calibration

Every (workload, framework) pair runs in its own fresh subprocess, so thread pools,
compilation caches and peak RSS are independent. dpscale runs with this interpreter;
the peers run with ``--peers-python`` (default ``/work/venv-peers/bin/python``, a separate
virtualenv -- peers are never dependencies of dpscale). A peer that is not importable
there is skipped with a note in the table. Each run appends its tables to ``--output`` (default: a
scratch file under the system's temporary directory); the figures that stand go, with this command and
the commit, into the table at the top of ``benchmarks/results/peers.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = Path(tempfile.gettempdir()) / "dpscale-benchmarks" / "peers.md"
NOISE = 1.0
# workload -> (physical, logical, repeats); quick uses smaller batches and fewer repeats. The conv
# models' physical batches are benchmarks.dp_step_cost's micro-batches (256 and 64).
FULL = {
    "cnn-small": (256, 512, 3),
    "wrn-16-4": (64, 128, 2),
    "linear-2^16": (2**16, 2**16, 3),
    "linear-2^18": (2**18, 2**18, 3),
}
# Quick keeps the linear batch at 2^14: jax-privacy's vmap(grad) needs 3.4 GB and minutes at 2^16.
QUICK = {"cnn-small": (32, 64, 2), "linear-2^14": (2**14, 2**14, 3)}
# (label, module, framework arg, private?, uses peers interpreter?)
RUNNERS = (
    ("dpscale", "peers_run_jax", "dpscale", True, False),
    ("dpscale", "peers_run_jax", "dpscale-nonprivate", False, False),
    ("dpscale, vmap(grad) path", "peers_run_jax", "dpscale-vmap", True, False),
    ("opacus", "peers_run_torch", "opacus", True, True),
    ("opacus", "peers_run_torch", "torch", False, True),
    ("jax-privacy", "peers_run_jax", "jax-privacy", True, True),
    ("opacus, plain conv (no WS)", "peers_run_torch", "opacus-plainconv", True, True),
)
PEER_IMPORTS = {
    "opacus": "import torch, opacus",
    "jax-privacy": "import jax_privacy",
    "opacus, plain conv (no WS)": "import torch, opacus",
}


def _machine() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs ({model}), load average {load} at start"


def _run(python: str, module: str, argv: list[str], timeout: float) -> list[dict]:
    cmd = [python, "-m", f"benchmarks.{module}", *argv]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return [{"status": f"timeout after {timeout:.0f} s"}]
    found = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("PEERS-RESULT ")]
    if not found:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [{"status": f"failed: {tail[:160]}"}]
    return found


def _available(python: str) -> dict[str, str | None]:
    """Peer name -> None if importable with ``python``, else the reason it is skipped."""
    notes = {}
    for peer, statement in PEER_IMPORTS.items():
        if not Path(python).exists():
            notes[peer] = f"skipped: {python} not found"
            continue
        proc = subprocess.run([python, "-c", statement], capture_output=True, text=True)
        notes[peer] = (
            None
            if proc.returncode == 0
            else "skipped: " + (proc.stderr.strip().splitlines() or ["not importable"])[-1][:120]
        )
    return notes


def _fmt(value: float | None, spec: str = ",.1f") -> str:
    return "-" if value is None else format(value, spec)


def _speed_table(rows: list[dict]) -> list[str]:
    lines = [
        "| workload | phys / logical batch | framework | step | ex/s (wall) | CPU ms / ex | peak RSS MB"
        " | DP / non-private (wall; CPU) | dpscale vs this, same step (wall; CPU) | load1 |",
        "|---|---|---|---|---:|---:|---:|---|---|---:|",
    ]
    index = {(r["workload"], r["label"], r["private"]): r for r in rows}
    for r in rows:
        ok = r.get("status") == "ok"
        ratio, vs = "", ""
        other = index.get((r["workload"], r["label"], not r["private"]))
        if ok and r["private"] and other and other.get("status") == "ok":
            ratio = (
                f"{other['examples_per_s'] / r['examples_per_s']:.2f}; "
                f"{r['cpu_ms_per_example'] / other['cpu_ms_per_example']:.2f}"
            )
        ours = index.get((r["workload"], "dpscale", r["private"]))
        if ok and r["label"] != "dpscale" and ours and ours.get("status") == "ok":
            vs = (
                f"{ours['examples_per_s'] / r['examples_per_s']:.2f}x; "
                f"{r['cpu_ms_per_example'] / ours['cpu_ms_per_example']:.2f}x"
            )
        step = ("DP" if r["private"] else "non-private") + (f" ({r['mode']})" if r.get("mode") else "")
        cells = (
            [_fmt(r["examples_per_s"]), _fmt(r["cpu_ms_per_example"], ".4g"), _fmt(r["peak_rss_mb"], ",.0f")]
            if ok
            else [r.get("status", "?"), "", ""]
        )
        lines.append(
            f"| {r['workload']} | {r['physical']} / {r['logical']} | {r['label']} | {step} | "
            + " | ".join(cells)
            + f" | {ratio} | {vs} | {_fmt(r.get('load1'), '.1f')} |"
        )
    return lines


def _calibration_table(rows: list[dict]) -> list[str]:
    lines = [
        "| framework | accountant | target epsilon | noise multiplier | achieved epsilon (own) | seconds |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        sigma = _fmt(r.get("sigma"), ".4f") if "sigma" in r else r.get("error", r.get("status", "?"))
        lines.append(
            f"| {r.get('framework', '?')} | {r.get('accountant', '')} | {r.get('target', '')} | {sigma} | "
            f"{_fmt(r.get('epsilon'), '.4f')} | {_fmt(r.get('seconds'), '.1f')} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workloads", default=None, help="comma-separated subset")
    parser.add_argument("--peers-python", default="/work/venv-peers/bin/python")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per subprocess")
    parser.add_argument("--warmup", type=int, default=1, help="untimed logical steps per row")
    parser.add_argument("--skip-calibration", action="store_true")
    parser.add_argument("--output", type=Path, default=RUNS)
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    if args.workloads:
        plan = {w: FULL.get(w) or QUICK[w] for w in args.workloads.split(",")}
    machine = _machine()
    notes = _available(args.peers_python)
    rows = []
    for workload, (physical, logical, repeats) in plan.items():
        for label, module, framework, private, peer in RUNNERS:
            row = {"workload": workload, "label": label, "private": private, "physical": physical, "logical": logical}
            if peer and notes.get(label):
                rows.append({**row, "status": notes[label]})
                continue
            if framework == "opacus" and workload.startswith("linear"):
                framework, row["mode"] = "opacus-ghost", "ghost clipping"
            if framework == "dpscale-vmap" and workload.startswith("linear"):
                continue  # the linear workloads have their closed form only
            if framework == "opacus-plainconv" and workload != "cnn-small":
                continue  # only on the CNN: the WRN run would double Opacus's long share
            if framework == "opacus" and not workload.startswith("linear"):
                row["mode"] = "hooks + functorch for WS conv"
            argv = [
                "--framework",
                framework,
                "--workload",
                workload,
                "--physical",
                str(physical),
                "--logical",
                str(logical),
                "--repeats",
                str(repeats),
                "--noise-multiplier",
                str(NOISE),
                "--warmup",
                str(args.warmup),
            ]
            python = args.peers_python if peer else sys.executable
            result = _run(python, module, argv, args.timeout)[0]
            rows.append({**row, **result})
            print(
                workload,
                label,
                framework,
                {k: result.get(k) for k in ("status", "examples_per_s", "cpu_ms_per_example", "peak_rss_mb", "load1")},
                flush=True,
            )
    calibration = []
    if not args.skip_calibration:
        calibration += _run(sys.executable, "peers_calibration", ["--framework", "dpscale"], args.timeout)
        if notes.get("opacus"):
            calibration.append({"framework": "opacus", "status": notes["opacus"]})
        else:
            calibration += _run(args.peers_python, "peers_calibration", ["--framework", "opacus"], args.timeout)
        for r in calibration:
            print(r, flush=True)
    _write(args, machine, rows, calibration)


def _write(args, machine: str, rows: list[dict], calibration: list[dict]) -> None:
    command = "python -m benchmarks.peers " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    versions = {
        k: v
        for r in rows
        if r.get("status") == "ok"
        for k, v in r.items()
        if k in ("jax", "torch", "opacus", "jax_privacy")
    }
    lines = [
        f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} ({'quick' if args.quick else 'full'})\n",
        f"Command: `{command}`  ",
        f"Machine: {machine}; load average {load} at the end.  ",
        f"Versions: {', '.join(f'{k} {v}' for k, v in sorted(versions.items()))}; noise multiplier {NOISE}, "
        "clip norm 1, one fresh subprocess per row, median of the timed logical steps after "
        f"{args.warmup} warm-up step(s).\n",
        *_speed_table(rows),
    ]
    if calibration:
        lines += [
            "",
            "ImageNet-sized calibration (N = 1,281,167, B = 16,384, T = 71,589, delta = 8e-7):",
            "",
            *_calibration_table(calibration),
        ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if not args.output.exists():
        args.output.write_text(
            "# dpscale vs Opacus vs jax-privacy\n\nProduced by `python -m benchmarks.peers` "
            "(see `benchmarks/peers.py`).\n"
        )
    with args.output.open("a") as handle:
        handle.write("\n".join(lines) + "\n")
    print(f"appended to {args.output}")


if __name__ == "__main__":
    main()
