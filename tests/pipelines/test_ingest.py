"""The ingest graph: when it runs in parallel, options from the CLI, shard planning, the graph itself."""

import apache_beam as beam
import numpy as np
from apache_beam.options.pipeline_options import GoogleCloudOptions, StandardOptions

from dpscale.data.sources import parse_source, plan_source
from dpscale.pipelines import ingest as graph
from dpscale.pipelines.runner import pipeline_options
from dpscale.stages import ingest as stage


def test_two_workers_only_for_large_inputs():
    assert graph.parallel(60_000) and not graph.parallel(100)


def test_cli_forwards_beam_options_to_the_stage(config_from_cli, tmp_path):
    config = config_from_cli(
        stage,
        [
            "ingest",
            "digits",
            str(tmp_path),
            "--validation-fraction",
            "0.1",
            "--runner",
            "DataflowRunner",
            "--project",
            "p",
            "--",
            "--temp_location",
            "gs://b/t",
        ],
    )
    assert config.validation_fraction == 0.1
    options = pipeline_options(config.pipeline_args, parallel=False)
    assert options.view_as(StandardOptions).runner == "DataflowRunner"
    assert options.view_as(GoogleCloudOptions).project == "p"
    assert options.view_as(GoogleCloudOptions).temp_location == "gs://b/t"


def test_shards_per_split_accounts_for_validation():
    shards = graph.shards_per_split(
        {"train": 50_000, "test": 10_000}, validation_fraction=0.1, examples_per_shard=10_000
    )
    assert shards == {"train": 5, "test": 1, "validation": 1}
    assert graph.shards_per_split({"train": 0}, validation_fraction=0, examples_per_shard=10) == {"train": 1}


def test_graph_builds_for_a_remote_output_without_running():
    """Graph construction touches no files, so a gs:// output needs no credentials here."""
    plan = plan_source(parse_source("digits"))
    pipeline = beam.Pipeline(options=pipeline_options([], parallel=False))
    graph.build(
        pipeline,
        plan,
        graph.GraphSettings(
            output_dir="gs://b/out",
            validation_fraction=0.1,
            encoding="raw",
            num_inputs=1797,
            shards_per_split={"train": 1, "test": 1, "validation": 1},
        ),
    )
    labels = {t.unique_name for t in pipeline.to_runner_api().components.transforms.values()}
    assert {"ReadDecodeEncode", "GroupShards", "WriteShards", "WriteManifest"} <= labels


def test_pipeline_runs_multi_processing_with_two_workers(tmp_path):
    """The local default for big inputs (two worker processes) produces the same data."""
    args = ("--runner=FnApiRunner", "--direct_num_workers=2", "--direct_running_mode=multi_processing")
    one = stage.run(
        stage.IngestConfig("digits", str(tmp_path / "a"), pipeline_args=("--direct_running_mode=in_memory",))
    )
    two = stage.run(stage.IngestConfig("digits", str(tmp_path / "b"), pipeline_args=args))
    assert one.manifest == two.manifest
    assert two.num_examples["train"] + two.num_examples["test"] == 1797
    a = (tmp_path / "a" / "train-00000-of-00001.array_record").read_bytes()
    b = (tmp_path / "b" / "train-00000-of-00001.array_record").read_bytes()
    assert np.frombuffer(a, np.uint8).size > 0 and a == b  # byte-identical shards
