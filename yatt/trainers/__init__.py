"""Training backends: own a model + optimizer and turn a loss function into parameter updates."""
