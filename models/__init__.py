"""Flax models that train under DP (GroupNorm/WS, normaliser-free) and a registry of them."""
