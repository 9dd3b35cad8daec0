"""dspark: a literate serving engine for DeepSeek-V4-Flash with DSpark speculative decoding.

The package is exported from the notebooks in `nbs/`; this file only gathers the public API.
"""
__version__ = "0.1.0"

from dspark.config import ConfigError, ModelConfig, load_config, preset
from dspark.checkpoint import CheckpointError, load_target, make_tiny_checkpoint, save_checkpoint
from dspark.model import Transformer
from dspark.sampling import SamplingParams
from dspark.tokenizer import Tokenizer
from dspark.engine import LLM, CompletionOutput, RequestOutput
