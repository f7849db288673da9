"""Device ownership: which role (rollout, genrm, train, ...) owns each device at each moment."""
