"""Near-duplicate detection of public images against private ones: descriptors, nearest neighbours, verification, outputs."""
