"""Ingested datasets: sources, the record format, shards, the manifest, and reading by index."""
