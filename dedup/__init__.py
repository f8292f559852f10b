"""Near-duplicate detection of public images against private ones: signatures, candidate join, outputs."""
