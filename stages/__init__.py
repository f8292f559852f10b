"""The commands of dpscale, one module each: a typed ``Config``, a typed ``Result`` and ``run(config)``."""
