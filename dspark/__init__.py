__version__ = "0.0.1"
"""dspark: a literate serving engine for DeepSeek-V4-Flash with DSpark speculative decoding.

The package is exported from the notebooks in `nbs/`; this file gathers the public API (and makes the one
process-wide decision below).
"""
from dspark.config import __version__

import os as _os
import sys as _sys

import torch as _torch

# Without CUDA, Triton can only interpret kernels, and it must be told before it is first imported — which
# the reference path itself may trigger (torch imports triton lazily). So it is decided here, once.
if "triton" not in _sys.modules and "TRITON_INTERPRET" not in _os.environ and not _torch.cuda.is_available():
    _os.environ["TRITON_INTERPRET"] = "1"

from dspark.config import ConfigError, ModelConfig, load_config, preset
from dspark.model.layers import batch_invariant, is_batch_invariant
from dspark.model.checkpoint import CheckpointError, load_target, make_tiny_checkpoint, save_checkpoint
from dspark.model.transformer import Transformer
from dspark.sample.sampling import SamplingParams
from dspark.tokenizer import Tokenizer
from dspark.engine.outputs import CompletionOutput, RequestOutput
from dspark.entrypoints.llm import LLM
