"""How dpscale runs a Beam graph: runner options, local progress, one call.

``run_pipeline`` is what every data stage (ingest, dedup, featurize) calls: it turns the
command line's pipeline arguments into Beam options, adds local defaults only where the user
gave none, shows progress when the workers share this machine's disk, and runs the graph.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions

from dpscale.pipelines.progress import LocalProgress

DEFAULT_RUNNER = "FnApiRunner"
_LOCAL_RUNNERS = ("directrunner", "direct", "fnapirunner", "bundlebaseddirectrunner")


def pipeline_options(args: Sequence[str], *, parallel: bool) -> PipelineOptions:
    """Beam options from command-line style ``args``; local defaults only fill gaps.

    Without ``--runner`` this is the local engine behind Beam's DirectRunner
    (``FnApiRunner``; naming it directly skips DirectRunner's attempt to fetch the Prism
    binary from the internet on every run), on both cores (multi-processing) when
    ``parallel`` and one in-memory worker otherwise, where process start-up and pickling
    cost more than they save. Anything given explicitly wins.
    """
    options = PipelineOptions(list(args))
    standard = options.view_as(StandardOptions)
    if standard.runner is None:
        standard.runner = DEFAULT_RUNNER
    if standard.runner.lower() in ("directrunner", "direct", "fnapirunner"):
        direct = options.view_as(DirectOptions)
        given = " ".join(args)
        if "direct_num_workers" not in given:
            direct.direct_num_workers = 2 if parallel else 1
        if "direct_running_mode" not in given:
            direct.direct_running_mode = ("in_memory" if direct.direct_num_workers == 1
                                          else "multi_processing")
    return options


def is_local_runner(options: PipelineOptions) -> bool:
    """Whether workers share this machine's disk (progress markers can reach us)."""
    return str(options.view_as(StandardOptions).runner or "").lower() in _LOCAL_RUNNERS


def run_pipeline(build: Callable[..., object], *, args: Sequence[str], parallel: bool,
                 progress_total: int, progress_label: str, log: logging.Logger) -> None:
    """Build the graph with ``build(pipeline, progress_dir)`` and run it to completion.

    ``progress_dir`` is where workers ``mark`` finished work (None on a remote runner, whose
    own monitoring takes over).
    """
    import apache_beam as beam

    options = pipeline_options(args, parallel=parallel)
    progress = (LocalProgress(progress_total, label=progress_label, log=log)
                if is_local_runner(options) else None)
    with progress or contextlib.nullcontext(), beam.Pipeline(options=options) as pipeline:
        build(pipeline, progress.directory if progress else None)
