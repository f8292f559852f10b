"""Compare a virtualenv's installed versions (``pip freeze``) with the lock (``constraints.txt``).

    python3 .ci/freeze_vs_lock.py VENV_PYTHON --exact    # installed == lock (a venv of every extra)
    python3 .ci/freeze_vs_lock.py VENV_PYTHON --subset   # each installed package at its locked version
    python3 .ci/freeze_vs_lock.py VENV_PYTHON --diff     # which versions differ (exit 0: for a failure's report)

dpscale itself and pip are left out; ``--subset`` and ``--diff`` also leave out setuptools and wheel at
other versions than the lock's (the virtualenv's own, when the install did not ask for them). Standard library only: it runs before anything
is installed.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
IGNORED = {"dpscale", "pip"}
BOOTSTRAP = {"setuptools", "wheel"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lines: list[str]) -> dict[str, str]:
    """``name==version`` lines -> {canonical name: version}; comments, editables and URLs are skipped."""
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            name, version = line.split("==", 1)
            found[canonical(name.split("[", 1)[0].strip())] = version.split(";", 1)[0].strip()
    return found


def installed(python: str) -> dict[str, str]:
    freeze = subprocess.run(
        [python, "-m", "pip", "freeze", "--all", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {k: v for k, v in pins(freeze.splitlines()).items() if k not in IGNORED}


def differences(have: dict[str, str], lock: dict[str, str], *, missing: bool) -> list[str]:
    rows = [(n, lock[n], have[n]) for n in sorted(have.keys() & lock.keys()) if have[n] != lock[n]]
    rows += [(n, "-", have[n]) for n in sorted(have.keys() - lock.keys())]
    if missing:
        rows += [(n, lock[n], "-") for n in sorted(lock.keys() - have.keys())]
    if not rows:
        return []
    width = max(len(n) for n, _, _ in rows)
    return [f"  {'package':<{width}}  {'lock':<14} installed"] + [
        f"  {n:<{width}}  {locked:<14} {now}" for n, locked, now in rows
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("python", help="the virtualenv's python")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--exact", action="store_true", help="fail unless installed == lock")
    mode.add_argument("--subset", action="store_true", help="fail unless every installed package is at its pin")
    mode.add_argument("--diff", action="store_true", help="print the versions that differ; never fail")
    parser.add_argument("--lock", default=str(ROOT / "constraints.txt"))
    args = parser.parse_args()

    lock = pins(pathlib.Path(args.lock).read_text().splitlines())
    have = installed(args.python)
    if not args.exact:  # the virtualenv's own setuptools and wheel, unless the install asked for them
        have = {k: v for k, v in have.items() if k not in BOOTSTRAP or k in lock and v == lock[k]}
    rows = differences(have, lock, missing=args.exact)
    name = pathlib.Path(args.lock).name
    if args.diff:
        print(f"ci: installed versions that differ from {name} ({len(rows) - 1 if rows else 0}):")
        print("\n".join(rows) if rows else "  none")
        return 0
    if rows:
        what = "equal" if args.exact else "follow"
        print(f"ci: the installed versions do not {what} {name} (refresh it: bash .ci/lock):", file=sys.stderr)
        print("\n".join(rows), file=sys.stderr)
        return 1
    print(f"ci: installed versions {'equal' if args.exact else 'follow'} {name} ({len(have)} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
