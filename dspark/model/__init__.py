"""Floor 2: the reference DeepSeek-V4 target (fp32 on CPU is the oracle), quantisation formats, the checkpoint layout, the DSpark and MTP drafters."""
