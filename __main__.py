"""``python -m dpscale`` runs the CLI."""

from dpscale.cli import main

main()
