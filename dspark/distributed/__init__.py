"""Floor 8: tensor parallelism: sharding the model, and the TP core that runs one engine per rank with rank 0 canonical."""
