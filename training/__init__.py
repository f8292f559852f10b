"""What a training run is made of: settings, model and feeds, the trainer, the run directory, scoring."""
