"""Stateless units of work: each a pure ``run(config) -> result`` over a frozen dataclass config."""
