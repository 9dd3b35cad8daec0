"""Floor 10 (top): training the embedded model and benchmarking; nothing in the engine imports these."""
