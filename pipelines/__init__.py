"""Apache Beam graphs composing the per-element stage transforms."""
