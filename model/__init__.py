"""Synthformer models: `ModelConfig` + `build_model` (see model/lm.py for the architecture)."""
from model.config import ConfigError, ModelConfig
from model.lm import SynthesizerLM, build_model

__all__ = ["ConfigError", "ModelConfig", "SynthesizerLM", "build_model"]
