"""Hand-run measurements (not installed with dpscale); a package so `python -m benchmarks.<name>` resolves here first."""
