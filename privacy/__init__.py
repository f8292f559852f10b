"""Everything that makes the privacy guarantee: clipping, noise, sampling, accounting, calibration."""
