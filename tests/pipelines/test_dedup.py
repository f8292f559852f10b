"""The dedup graph: Beam options pass through, graph shape, two local worker processes."""

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.options.pipeline_options import GoogleCloudOptions, StandardOptions
from PIL import Image

from dpscale.data.dataset import IngestedDataset
from dpscale.dedup.join import PRIVATE, PUBLIC, ReadTask
from dpscale.dedup.method import Method
from dpscale.dedup.planning import knn_tasks, public_positions
from dpscale.pipelines import dedup as graph
from dpscale.pipelines.runner import pipeline_options
from dpscale.stages import dedup as stage
from dpscale.stages.ingest import IngestConfig
from dpscale.stages.ingest import run as ingest


def _smooth(seed: int) -> np.ndarray:
    low = np.random.default_rng(seed).integers(0, 256, (5, 5, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(low).resize((32, 32), Image.Resampling.BICUBIC))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """One dataset: 4 test images, train = 8 unrelated + mirrored copies of tests 0 and 2."""
    root = tmp_path_factory.mktemp("src")
    for split, images in [
        ("test", [_smooth(i) for i in range(4)]),
        ("train", [_smooth(100 + i) for i in range(8)] + [_smooth(0)[:, ::-1], _smooth(2)[:, ::-1]]),
    ]:
        for i, im in enumerate(images):
            path = root / split / "c" / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.ascontiguousarray(im)).save(path)
    out = tmp_path_factory.mktemp("ds") / "both"
    ingest(
        IngestConfig(
            f"folder:{root}", str(out), examples_per_shard=4, pipeline_args=("--direct_running_mode=in_memory",)
        )
    )
    return str(out)


def test_cli_forwards_beam_options_to_the_stage(config_from_cli, tmp_path):
    config = config_from_cli(
        stage,
        [
            "dedup",
            "pub",
            "priv",
            str(tmp_path / "o"),
            "--threshold",
            "0.04",
            "--runner",
            "DataflowRunner",
            "--project",
            "p",
            "--",
            "--temp_location",
            "gs://b/t",
        ],
    )
    assert (config.public, config.private, config.threshold) == ("pub", "priv", 0.04)
    options = pipeline_options(config.pipeline_args, parallel=False)
    assert options.view_as(StandardOptions).runner == "DataflowRunner"
    assert options.view_as(GoogleCloudOptions).project == "p"
    assert options.view_as(GoogleCloudOptions).temp_location == "gs://b/t"


def test_graph_builds_for_remote_paths_without_running():
    """Graph construction touches no files, so gs:// paths need no credentials here."""
    tasks = (ReadTask(PUBLIC, "train", 0, 10), ReadTask(PRIVATE, "test", 0, 3))
    settings = graph.GraphSettings(
        public="gs://b/pub",
        private="gs://b/priv",
        output_dir="gs://b/out",
        work_dir="gs://b/out/_dedup_work",
        method=Method(),
        num_public=10,
        num_private=3,
        num_classes=2,
        image_shape=(32, 32, 3),
        tasks=tasks,
        knn_tasks=tuple(knn_tasks(tasks)),
        shard_ranges={("train", 0): (0, 10, 1)},
        public_positions=public_positions(tasks),
        verify_blocks=((("test", 0), 3),),
    )
    pipeline = beam.Pipeline(options=pipeline_options([], parallel=False))
    graph.build(pipeline, settings)
    labels = {t.unique_name for t in pipeline.to_runner_api().components.transforms.values()}
    assert {
        "Describe",
        "Neighbours",
        "TopKPerPrivate",
        "Verify",
        "ClosestPrivate",
        "GroupShard",
        "WriteShards",
        "WriteReport",
    } <= labels


def test_plans_follow_shards_and_neighbour_tasks_grow_with_images(dataset):
    ds = IngestedDataset(dataset)
    tasks = stage.read_tasks(ds, PUBLIC, 3, ["train"])
    ranges = stage.shard_ranges(ds, ["train"])
    assert sum(t.stop - t.start for t in tasks) == 10
    for t in tasks:  # a task never straddles its shard
        start, stop, _ = ranges[("train", t.shard)]
        assert start <= t.start < t.stop <= stop
    private = [ReadTask(PRIVATE, "test", s, s + 2) for s in (0, 2)]
    pairs = knn_tasks(tasks + private, public_per_task=6)
    assert len(pairs) == 2 * 2  # 2 private tasks x 2 public groups of <= 6 images
    for p, group in pairs:  # every public image is searched once per private task
        assert p.side == PRIVATE and all(t.side == PUBLIC for t in group)
    assert sorted(t.start for p, g in pairs if p == private[0] for t in g) == [t.start for t in tasks]


def test_two_worker_processes_give_the_same_result_as_one(dataset, tmp_path):
    args = ("--runner=FnApiRunner", "--direct_num_workers=2", "--direct_running_mode=multi_processing")
    runs = {}
    for name, beam_args in [("one", ("--direct_running_mode=in_memory",)), ("two", args)]:
        runs[name] = stage.run(
            stage.DedupConfig(
                dataset,
                dataset,
                str(tmp_path / name),
                public_splits=("train",),
                private_splits=("test",),
                examples_per_task=3,
                pipeline_args=beam_args,
            )
        )
    one, two = runs["one"], runs["two"]
    assert sorted((p["public_key"], p["private_key"]) for p in two.report["removed"]) == [
        ("train/c/8.png", "test/c/0.png"),
        ("train/c/9.png", "test/c/2.png"),
    ]
    assert one.report["removed"] == two.report["removed"]
    assert one.manifest.content_hash == two.manifest.content_hash
    assert IngestedDataset(str(tmp_path / "two")).num_examples("train") == 8
