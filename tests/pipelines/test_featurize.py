"""The featurize graph: when it runs in parallel, options from the CLI, graph shape (no network)."""

import apache_beam as beam
from apache_beam.options.pipeline_options import GoogleCloudOptions, StandardOptions

from dpscale.pipelines import featurize as graph
from dpscale.pipelines.runner import pipeline_options
from dpscale.stages import featurize as stage


def test_two_workers_only_when_there_is_enough_work():
    assert graph.parallel(59) and not graph.parallel(graph.MIN_CHUNKS_FOR_TWO_WORKERS - 1)


def test_cli_forwards_beam_options_to_the_stage(config_from_cli, tmp_path):
    config = config_from_cli(
        stage,
        [
            "featurize",
            str(tmp_path),
            "--backbone",
            "efficientnet-lite0",
            "--resolution",
            "128",
            "--runner",
            "DataflowRunner",
            "--project",
            "p",
            "--",
            "--temp_location",
            "gs://b/t",
        ],
    )
    assert (config.resolution, config.backbone, config.chunk_rows) == (128, "efficientnet-lite0", 1024)
    options = pipeline_options(config.pipeline_args, parallel=True)
    assert options.view_as(StandardOptions).runner == "DataflowRunner"
    gcp = options.view_as(GoogleCloudOptions)
    assert (gcp.project, gcp.temp_location) == ("p", "gs://b/t")


def test_graph_builds_for_remote_paths_without_running():
    """Building the graph touches no files: gs:// data and cache need no credentials here."""
    pipeline = beam.Pipeline(options=pipeline_options([], parallel=False))
    settings = graph.WorkerSettings(
        data="gs://b/data", backbone="gs://b/backbone", entry="gs://b/cache/abc", batch_size=32
    )
    graph.build(pipeline, [("train", 0), ("train", 1), ("test", 0)], settings)
    labels = {t.unique_name for t in pipeline.to_runner_api().components.transforms.values()}
    assert {"Chunks", "SpreadChunks", "FeaturizeChunks"} <= labels
