"""The architecture cannot decay: package order, no import cycles, commands only in stages/,
and the DP mechanism assembled in one place.

Imports are read from the source (every ``import`` statement, including those inside
functions), so a lazy import that breaks the order is caught too.
"""

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Lowest first. A module may import from its own package and from packages of lower layers only.
LAYERS = [
    {"errors"},
    {"gcs"},
    {"files"},
    {"progress", "distributed"},
    {"models"},
    {"privacy", "data"},
    {"cache", "dedup"},
    {"training"},
    {"audit", "pipelines"},
    {"stages"},
    {"cli_options", "cli_output"},
    {"cli_prepare"},
    {"cli"},
    {"__main__"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _source_files():
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if parts[0] in ("tests", "benchmarks", ".venv", "build") or parts[0].startswith("."):
            continue
        yield path


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["dpscale", *parts])


def _imports(path: pathlib.Path) -> set[str]:
    """Every dpscale module this file imports (``from dpscale.x import y`` counts x and x.y)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dpscale":
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "dpscale")
    return found


MODULES = {_module(path): path for path in _source_files()}


def _resolve(name: str) -> str | None:
    """The module a dotted import name refers to (``dpscale.a.b.Name`` -> ``dpscale.a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "dpscale"


GRAPH = {
    module: {_resolve(name) for name in _imports(path)} - {None, module, "dpscale"} for module, path in MODULES.items()
}


def test_every_package_has_a_layer():
    assert {_package(m) for m in MODULES} - {"dpscale", "__init__"} <= set(LAYER)


def test_no_package_imports_one_above_it_or_beside_it():
    wrong = []
    for module, imported in GRAPH.items():
        mine = _package(module)
        for other in imported:
            theirs = _package(other)
            if theirs != mine and LAYER[theirs] >= LAYER[mine]:
                wrong.append(f"{module} -> {other}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


TUNING = "dpscale.privacy.tuning"


def test_the_guarantee_never_imports_the_speed_tuning():
    """privacy/ carries the bound; privacy/tuning/ chooses paths for speed only. The tuning may import
    the guarantee (its proven paths, to choose among), never the other way round, so no timing, cost
    model or device default can reach a bound (docs/architecture.md)."""
    guarantee = [m for m in MODULES if _package(m) == "privacy" and not m.startswith(TUNING)]
    assert "dpscale.privacy.ghost" in guarantee and "dpscale.privacy.layer_bounds" in guarantee
    wrong = [f"{m} -> {o}" for m in guarantee for o in GRAPH[m] if o.startswith(TUNING)]
    assert not wrong, "the guarantee imports the tuning:\n" + "\n".join(sorted(wrong))
    assert any(o.startswith(TUNING) for m in MODULES for o in GRAPH[m]), "nothing uses the tuning: the test is void"


def test_no_import_cycles_between_modules():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(GRAPH[module]):
            if state.get(other) == 1:
                cycles.append(" -> ".join(path[path.index(other) :] + [other]))
            elif other not in state:
                visit(other, path + [other])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


STAGE_MODULES = sorted(m for m in MODULES if m.startswith("dpscale.stages."))


@pytest.mark.parametrize("name", STAGE_MODULES)
def test_stages_hold_only_commands_with_a_config_a_result_and_run(name):
    module = importlib.import_module(name)
    public = [n for n in vars(module) if not n.startswith("_")]
    assert callable(getattr(module, "run", None))
    assert any(n.endswith("Config") for n in public) and any(n.endswith("Result") for n in public)
    others = {m for m in GRAPH[name] if m.startswith("dpscale.stages.")}
    if name.rsplit(".", 1)[1] not in ("quickstart", "sweep"):  # compositions of commands by design
        assert not others, f"{name} calls other commands: {others}"


def test_every_command_is_one_stage_module():
    from dpscale.cli import cli

    modules = {name.rsplit(".", 1)[1] for name in STAGE_MODULES}
    expected = {"list_models" if c == "models" else c.replace("-", "_") for c in cli.commands}
    assert expected == modules


CLI_PACKAGES = {"cli", "cli_prepare", "cli_options", "cli_output"}  # the command line and its own helpers


def _imports_by_name(path: pathlib.Path) -> list[str]:
    """The literal start of every ``import_module(...)`` argument in the file ('' when not a literal)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
            first = node.args[0] if node.args else None
            if isinstance(first, ast.JoinedStr):
                first = first.values[0] if first.values else None
            found.append(first.value if isinstance(first, ast.Constant) else "")
    return found


def test_the_command_line_imports_only_stages_errors_and_its_own_helpers():
    """cli parses flags and calls a stage's ``run``: whatever else it needs, a stage exposes."""
    cli_modules = sorted(m for m in MODULES if _package(m) in CLI_PACKAGES)
    assert "dpscale.cli" in cli_modules
    allowed = {"dpscale.stages", "dpscale.errors", *cli_modules}
    wrong = [
        f"{module} -> {other}"
        for module in cli_modules
        for other in sorted(GRAPH[module])
        if other not in allowed and not other.startswith("dpscale.stages.")
    ]
    wrong += [
        f"{module} -> import_module({name!r}...)"
        for module in cli_modules
        for name in _imports_by_name(MODULES[module])
        if not name.startswith("dpscale.stages.")
    ]
    assert not wrong, "the command line reaches past the stages:\n" + "\n".join(wrong)


def test_the_command_line_writes_through_a_module_that_needs_no_stage():
    """How results, warnings and errors are written (``cli_output``) is one thing for every command."""
    assert GRAPH["dpscale.cli_output"] == {"dpscale.errors"}


@pytest.mark.parametrize("module", ["dpscale.cli", "dpscale.cli_prepare"])
def test_the_command_modules_stay_short(module):
    """A command parses flags, builds a config, calls a stage and prints: more than 700 lines of that (as
    ruff formats it: a long call is an argument a line) is something else (output, checks, a second
    concept) that belongs in its own module."""
    lines = len(MODULES[module].read_text().splitlines())
    assert lines < 700, f"{module} has {lines} lines"


def _code_lines(*, benchmarks: bool):
    paths = [*_source_files(), *(sorted((ROOT / "benchmarks").glob("*.py")) if benchmarks else [])]
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if code.strip():
                yield path.relative_to(ROOT).as_posix(), number, code


@pytest.mark.parametrize(
    "pattern, allowed, benchmarks",
    [
        # The DP step and the samplers are built by the privacy plan only, benchmarks included, from
        # its parts (a deliberately broken step is a plan with other parts: audit.broken_steps).
        (r"\b(DpsgdStep|PoissonSampler|ShuffledSampler)\(", {"privacy/plan.py"}, True),
        (r"\bparts\.(step|poisson_sampler)\(", {"privacy/plan.py"}, True),
        # Every clipped sum states its sensitivity when it is made (privacy.clipping.ClippedSumFn).
        (
            r"\bClippedSumFn\(",
            {
                "privacy/clipping.py",
                "privacy/linear.py",
                "privacy/bookkeeping.py",
                "privacy/ghost.py",
                "audit/whitebox.py",
            },
            True,
        ),
        # DP noise is drawn in one module, and random streams of the secret seed are derived in one.
        # (dedup's copy model draws pixel noise as one of its copy edits: augmentation of public
        # images for a contrastive model, never part of a DP step.)
        (r"random\.normal\(|\berf_inv\(|\brng_bit_generator\(", {"privacy/noise.py", "dedup/copy_model.py"}, False),
        (r"\bkey_from_seed\(|_STREAM\b|default_rng\(\[", {"privacy/noise.py", "privacy/streams.py"}, False),
    ],
)
def test_the_mechanism_is_assembled_in_one_place(pattern, allowed, benchmarks):
    found = {(path, number) for path, number, code in _code_lines(benchmarks=benchmarks) if re.search(pattern, code)}
    outside = sorted(f"{path}:{number}" for path, number in found if path not in allowed)
    assert not outside, f"{pattern} used outside {sorted(allowed)}: {outside}"
    assert found, f"{pattern} matches nothing: the check has gone stale"


def test_no_module_attribute_is_reassigned():
    """Nothing swaps a part of a dpscale module for the whole process (``plan.DpsgdStep = Broken``):
    a broken step reaches an audit as a plan with other parts, visibly, where the plan is built."""
    module_names = {name.rsplit(".", 1)[-1] for name in MODULES}
    found = []
    for path in _source_files():
        tree = ast.parse(path.read_text())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("dpscale"))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpscale"):
                aliases.update(a.asname or a.name for a in node.names if a.name in module_names)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in aliases
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {target.value.id}.{target.attr}")
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "setattr"
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in aliases
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} setattr({node.args[0].id}, ...)")
    assert not found, f"module attributes reassigned: {found}"


def test_no_signature_takes_a_step_class():
    """A broken step reaches an audit as a plan with other parts (``audit.broken_steps.with_parts``)."""
    paths = [*_source_files(), *sorted((ROOT / "benchmarks").glob("*.py"))]
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        for path in paths
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and "step_class" in {a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]}
    ]
    assert not found, f"step_class parameters: {found}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_package_imports_a_private_name_of_another():
    """``from dpscale.x.y import _z`` only inside package x: a private name is no other package's API."""
    wrong = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dpscale"):
                continue
            names = [alias.name for alias in node.names]
            private = [n for n in names if _private(n)] + [p for p in node.module.split(".") if _private(p)]
            source = _resolve(node.module)
            if private and source is not None and _package(source) != _package(module):
                wrong.append(f"{module}:{node.lineno} imports {', '.join(private)} from {node.module}")
    assert not wrong, "private names imported across packages:\n" + "\n".join(sorted(wrong))
