"""Synthformer models: `ModelConfig` + `build_model` (see model/lm.py for the architecture)."""
from .config import ConfigError, ModelConfig
from .lm import SynthesizerLM, build_model

__all__ = ["ConfigError", "ModelConfig", "SynthesizerLM", "build_model"]
