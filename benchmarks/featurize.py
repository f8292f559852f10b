"""Featurize pipeline throughput vs the bare jitted forward pass of the same backbone.

For each resolution: (1) the bare forward: ``jit(model.apply(..., method="features"))`` on
already preprocessed float batches held in memory (no reading, resizing or writing);
(2) the pipeline: the real Beam graph of ``dpscale featurize`` (read by index, resize,
normalise, forward, Zarr write, chunk markers) over the first ``--subset`` rows of train
into a fresh cache, timed end to end including worker start-up and compilation.

    python -m benchmarks.featurize --data /tmp/cifar10 --backbone efficientnet-lite0 \\
        --resolutions 128,224 --subset 4096 --output featurize.md

The figures that stand go, with the command and the commit, into the table at the top of
``benchmarks/results/featurize.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import jax
import numpy as np

from dpscale.cache import feature_store as fstore
from dpscale.cache import featurizer
from dpscale.data.dataset import IngestedDataset
from dpscale.models.pretrained import load_pretrained
from dpscale.stages import featurize as stage


def bare_forward(backbone: str, resolution: int, *, batch: int, min_seconds: float) -> float:
    """Images/s of the jitted forward on preprocessed inputs (best of timed rounds)."""
    model, variables, prep = load_pretrained(backbone)
    forward = jax.jit(lambda x: model.apply(variables, x, method="features"))
    x = jax.random.normal(jax.random.key(0), (batch, resolution, resolution, len(prep.mean)))
    forward(x).block_until_ready()
    rates, start = [], time.perf_counter()
    while time.perf_counter() - start < min_seconds or len(rates) < 3:
        t = time.perf_counter()
        forward(x).block_until_ready()
        rates.append(batch / (time.perf_counter() - t))
    return float(np.median(rates))


def steady_rate(store: fstore.FeatureStore, chunks: list[tuple[str, int]], workers: int) -> float:
    """Images/s once every worker has finished its first chunk (start-up and compile excluded).

    From the chunk markers' modification times: rows of the chunks finished after the
    ``workers``-th marker, over the time from that marker to the last.
    """
    times = sorted((os.stat(store._marker(s, c)).st_mtime, store.layout.splits[s].rows(c)) for s, c in chunks)
    if len(times) <= workers:
        return float("nan")
    rows = sum(stop - start for _, (start, stop) in times[workers:])
    return rows / (times[-1][0] - times[workers - 1][0])


def pipeline(
    data: str,
    backbone: str,
    resolution: int,
    *,
    subset: int,
    batch: int,
    chunk_rows: int,
    pipeline_args: tuple[str, ...],
) -> tuple[float, float, int]:
    """Images/s of the Beam graph over the first ``subset`` train rows (fresh cache):
    end to end, and in steady state."""
    cache = tempfile.mkdtemp(prefix="dpscale-bench-features-")
    try:
        config = stage.FeaturizeConfig(
            data,
            backbone,
            cache_dir=cache,
            resolution=resolution,
            batch_size=batch,
            chunk_rows=chunk_rows,
            pipeline_args=pipeline_args,
        )
        with IngestedDataset(data) as ds:
            key, meta = featurizer.feature_key(ds, backbone, resolution=resolution)
            layout = fstore.EntryLayout(
                key=key,
                feature_dim=featurizer.row_shape(meta, key)[0],
                class_names=tuple(ds.class_names),
                splits={s: fstore.SplitLayout(ds.num_examples(s), chunk_rows) for s in ds.splits},
            )
        store = fstore.FeatureStore.create(cache, layout)
        chunks = [("train", c) for c in range(-(-subset // chunk_rows))]
        rows = sum(stop - start for start, stop in (layout.splits["train"].rows(c) for _, c in chunks))
        start = time.perf_counter()
        stage._run_pipeline(config, store, chunks)
        seconds = time.perf_counter() - start
        assert not set(chunks) & set(store.missing_chunks()), "pipeline lost chunks"
        from apache_beam.options.pipeline_options import DirectOptions

        from dpscale.pipelines import featurize as graph
        from dpscale.pipelines.runner import pipeline_options

        options = pipeline_options(pipeline_args, parallel=graph.parallel(len(chunks)))
        workers = options.view_as(DirectOptions).direct_num_workers or 1
        return rows / seconds, steady_rate(store, chunks, workers), rows
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--backbone", default="efficientnet-lite0")
    parser.add_argument("--resolutions", default="128,224")
    parser.add_argument("--subset", type=int, default=4096, help="train rows through the pipeline")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunk-rows", type=int, default=1024)
    parser.add_argument("--min-seconds", type=float, default=20.0)
    parser.add_argument("--pipeline-args", default="", help="Beam options, space separated")
    parser.add_argument("--output", default=None, help="append a markdown table here")
    args = parser.parse_args()
    lines = [
        "| resolution | bare forward img/s | pipeline img/s (end to end) | ratio | "
        "pipeline img/s (steady state) | ratio | rows | load avg |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for resolution in (int(r) for r in args.resolutions.split(",")):
        bare = bare_forward(args.backbone, resolution, batch=args.batch, min_seconds=args.min_seconds)
        rate, steady, rows = pipeline(
            args.data,
            args.backbone,
            resolution,
            subset=args.subset,
            batch=args.batch,
            chunk_rows=args.chunk_rows,
            pipeline_args=tuple(args.pipeline_args.split()),
        )
        line = (
            f"| {resolution} | {bare:.1f} | {rate:.1f} | {rate / bare:.2f} | {steady:.1f} | "
            f"{steady / bare:.2f} | {rows} | {os.getloadavg()[0]:.1f} |"
        )
        print(line, flush=True)
        lines.append(line)
    if args.output:
        with open(args.output, "a") as f:
            f.write(
                f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, batch {args.batch}, "
                f"chunk rows {args.chunk_rows}, pipeline args: `{args.pipeline_args or 'default'}`\n\n"
            )
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
