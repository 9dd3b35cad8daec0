"""Floor 9: what users call: `LLM`, the OpenAI-compatible server and its protocol."""
