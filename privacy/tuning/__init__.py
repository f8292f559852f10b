"""How the per-layer clipped sum runs fast on a device: each layer's path, precision and chunk.

Speed and memory only. Every choice made here is one of the paths proven for the layer's kind
(``privacy.ghost.PROVEN_PATHS``, checked when the clipped sum uses it), so a wrong, stale or
planted choice costs time, never the bound; the modules that carry the bound never import this
package (tests/test_architecture.py).
"""
