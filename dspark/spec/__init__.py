"""Floor 5: speculative decoding: the proposers (DSpark, MTP) and capacity-aware verification (policy and controller)."""
