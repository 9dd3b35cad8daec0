"""Floor 7: the scheduler, the engine core that glues schedule -> execute -> update, outputs, the async engine, metrics."""
