"""Floor 3: the paged KV cache and the cached reference forward over it."""
