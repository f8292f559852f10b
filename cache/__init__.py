"""The content-addressed Zarr feature store, its keys, and the featurizer that fills it."""
