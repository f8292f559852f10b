"""What kind of data a path holds, and the one refusal for a run or a score asked on data of another kind.

A run's mode is read off its data: ingested images (``images``), a feature-cache entry of pooled
features (``features``) or one of activations at a cut (``activations``). ``--mode`` only confirms it:
no mode can train on data of another kind, so a mismatch is refused in one line that says what the
data is and how to make the kind asked for, rather than failing later in the mode's own reader with
advice that fits neither (an entry "unfinished" because it is an ingested dataset).
"""

from __future__ import annotations

import json

from dpscale import files
from dpscale.errors import DataError

#: What each mode reads, as a refusal names it.
KINDS = {
    "images": "ingested images",
    "features": "pooled features (a feature-cache entry)",
    "activations": "activations at a cut (a feature-cache entry of `featurize --cut`)",
}
_METADATA = "dpscale_features.json"  # cache.feature_store.METADATA (this module imports no cache code)
_MANIFEST = "manifest.json"  # data.shards.MANIFEST


def detect_mode(data: str) -> str:
    """``features`` for a feature-cache entry of pooled features, ``activations`` for one cut at a
    layer, else ``images`` (an ingested dataset)."""
    path = files.join(data, _METADATA)
    if not files.isfile(path):
        return "images"
    try:
        cut = json.loads(files.read_text(path)).get("key", {}).get("cut")
    except (OSError, ValueError, AttributeError):
        return "features"  # opening it says what is wrong
    return "activations" if cut else "features"


def _source(data: str) -> str:
    """`` (SOURCE)``: the ingested dataset an entry was made from, as its metadata records it ("" if unknown)."""
    try:
        source = json.loads(files.read_text(files.join(data, _METADATA))).get("source")
    except (OSError, ValueError, AttributeError):
        source = None
    return f" ({source})" if source else ""


def _how(data: str, kind: str, mode: str) -> str:
    """How to get data of ``mode``'s kind from ``data``, which holds ``kind``."""
    if kind == "images":
        cut = " --cut CUT" if mode == "activations" else ""
        listed = "; `dpscale models` lists the cuts" if cut else ""
        return f"featurize it first (`dpscale featurize {data} --backbone BACKBONE{cut}`{listed}) and give the entry"
    if mode == "images":
        return f"give the ingested images it was made from{_source(data)}"
    other = "with --cut CUT" if mode == "activations" else "without --cut"
    return f"featurize its images{_source(data)} {other} and give that entry"


def resolve_mode(data: str, mode: str | None) -> str:
    """The mode of a run on ``data``: its kind; an explicit ``mode`` of another kind is refused."""
    kind = detect_mode(data)
    if mode is None or mode == kind:
        return kind
    if kind == "images" and not files.isfile(files.join(data, _MANIFEST)):
        raise DataError(f"{data!r} is neither an ingested dataset nor a feature-cache entry (--mode {mode})")
    raise DataError(
        f"--mode {mode} trains on {KINDS[mode]}, and {data!r} holds {KINDS[kind]}: leave --mode out to train "
        f"it in {kind} mode, or {_how(data, kind, mode)}"
    )


def check_kind_for_run(data: str, mode: str, *, made_with: str) -> None:
    """Refuse to score a ``mode`` run on ``data`` of another kind; ``made_with`` says how its kind is made."""
    kind = detect_mode(data)
    if kind != mode:
        raise DataError(
            f"{data!r} holds {KINDS[kind]}, and the run was trained on {KINDS[mode]}: evaluate it on {made_with}"
        )
