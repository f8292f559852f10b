"""Hand-run measurements, not installed with dpscale: run from the repository root as
``python -m benchmarks.<name>``. They import the library as ``dpscale.*`` (any install, editable
or not) and each other as ``benchmarks.<name>``, and reach dedup through its public names only.
"""
