"""Content-addressed Zarr feature store."""
