"""The controller shard: each torchrun rank runs the RL step for its own slice of the data."""
