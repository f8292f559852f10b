"""Random-access read speed of an ingested dataset, as the trainer's sampler reads it (by hand).

Draws batches of uniformly random indices (what a Poisson sampler produces) and times
``IngestedDataset.get``; prints examples/s per batch size.

    python -m benchmarks.ingest_read /tmp/bench/cifar10 --split train --batch-sizes 256,4096
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dpscale.data.dataset import IngestedDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--split", default="train")
    parser.add_argument("--batch-sizes", default="256,4096")
    parser.add_argument("--min-seconds", type=float, default=5.0)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with IngestedDataset(args.path) as ds:
        n = ds.num_examples(args.split)
        ds.get(args.split, [0])  # open the shards once
        print(f"{args.path} {args.split}: {n} examples of {ds.image_shape}, {ds.manifest['record_encoding']} records")
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            seen, start = 0, time.perf_counter()
            while time.perf_counter() - start < args.min_seconds:
                images, _ = ds.get(args.split, rng.integers(0, n, batch))
                seen += len(images)
            rate = seen / (time.perf_counter() - start)
            print(f"  batch {batch:>6}: {rate:,.0f} examples/s")


if __name__ == "__main__":
    main()
