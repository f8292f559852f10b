"""Benchmarks import one way: the library as ``dpscale.*``, each other as ``benchmarks.*``.

``dpscale.benchmarks.*`` only resolves in an editable install, and a benchmark that reaches into
a package's private names (or patches its module attributes) measures something the package does
not promise; both broke silently before.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))
# Deliberate reaches into the library outside dedup, each for a reason; nothing else may join them.
KNOWN = {
    "audit_whitebox.py": {"patches dpsgd.add_gaussian_noise"},  # injects the bug the audit must flag
    "noise_cost.py": {"patches dpsgd.add_gaussian_noise"},  # times the DP step with each noise
    "featurize.py": {"uses private stage._run_pipeline"},  # times the Beam graph without the stage around it
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _violations(tree: ast.Module) -> list[str]:
    found: list[str] = []
    library_names: set[str] = set()  # local names bound to dpscale modules or their members
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dpscale":
            if node.module.startswith("dpscale.benchmarks"):
                found.append(f"line {node.lineno}: from {node.module} (use benchmarks.*)")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"line {node.lineno}: imports private {node.module}.{alias.name}")
                library_names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dpscale.benchmarks"):
                    found.append(f"line {node.lineno}: import {alias.name} (use benchmarks.*)")
                if alias.name.split(".")[0] == "dpscale":
                    library_names.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in library_names:
            if _private(node.attr):
                found.append(f"line {node.lineno}: uses private {node.value.id}.{node.attr}")
            if isinstance(node.ctx, (ast.Store, ast.Del)):
                found.append(f"line {node.lineno}: patches {node.value.id}.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in library_names
        ):
            found.append(f"line {node.lineno}: {node.func.id} on {node.args[0].id}")
    return found


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_a_benchmark_uses_the_library_through_its_public_names(path):
    found = _violations(ast.parse(path.read_text(), filename=str(path)))
    assert [v for v in found if v.split(": ", 1)[1] not in KNOWN.get(path.name, ())] == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from dpscale.benchmarks.dedup_census import montage", "use benchmarks.*"),
        ("import dpscale.benchmarks.dedup_census", "use benchmarks.*"),
        ("from dpscale.dedup.verify import _blur", "imports private"),
        ("from dpscale.dedup import verify\nverify._blur(3, 32)", "uses private verify._blur"),
        ("from dpscale.dedup import verify\nverify.DETAIL_SIGMA = 2.0", "patches verify.DETAIL_SIGMA"),
        ("from dpscale.dedup import verify\nsetattr(verify, 'alignment_grid', None)", "setattr on verify"),
    ],
)
def test_the_check_catches_each_way_research_scripts_used_to_reach_in(source, expected):
    assert any(expected in v for v in _violations(ast.parse(source)))


def test_the_check_lets_the_one_way_through():
    source = "from benchmarks.peers_measure import emit\nfrom dpscale.dedup import refine\ncut = 1 - refine.MIN_RANK\n"
    assert _violations(ast.parse(source)) == []
