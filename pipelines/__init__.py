"""Apache Beam graphs (wiring only) and how dpscale runs them: runner options, local progress."""
