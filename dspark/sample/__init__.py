"""Floor 1: sampling and lossless rejection sampling in plain torch (keyed per-request streams); no model, no kernels."""
