"""SynthformerConfig: a ModelConfig dressed as a Hugging Face `PreTrainedConfig` (model_type "synthformer").

Every ModelConfig field is a field here, under the same name and with the same default, so the `config.json` of a
Hugging Face export (model/hf.py) is the release's `model` section plus the keys transformers reads. The standard
names that generation utilities and tools look up are aliases of ours:

    num_hidden_layers → n_layers     hidden_size → d_model     num_attention_heads → n_heads
    max_position_embeddings → max_seq_len                      vocab_size (same name)

Validation is ModelConfig's own: `__post_init__` builds one, which also fills the derived defaults (d_ffn = 4·d,
the factorized_dense split a·b = L), so a bad value fails here with the same one-line ConfigError as in training.
This file ships inside every export and is imported by transformers' remote-code loader, so it imports only
transformers and the model files next to it.
"""
from __future__ import annotations

from dataclasses import fields

from transformers import PreTrainedConfig

from .config import ModelConfig

_DEFAULTS = {f.name: f.default for f in fields(ModelConfig)}


class SynthformerConfig(PreTrainedConfig):
    """A GPT-style causal LM whose token mixers are Synthesizers; see model/config.py for what each field means."""

    model_type = "synthformer"
    attribute_map = {"num_hidden_layers": "n_layers", "hidden_size": "d_model",
                     "num_attention_heads": "n_heads", "max_position_embeddings": "max_seq_len"}

    # ModelConfig fields (defaults copied from it; the five size fields have none there, these are placeholders
    # so that transformers can build a default config, e.g. to compute a diff when saving).
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 128
    mixer: str | list[str] = _DEFAULTS["mixer"]
    factorized_k: int = _DEFAULTS["factorized_k"]
    factorized_a: int | None = None
    factorized_b: int | None = None
    impl: str = _DEFAULTS["impl"]
    block: str = _DEFAULTS["block"]
    d_ffn: int | None = None
    position: str = _DEFAULTS["position"]
    rope_base: float = _DEFAULTS["rope_base"]
    tie_embeddings: bool = _DEFAULTS["tie_embeddings"]
    bias: bool = _DEFAULTS["bias"]
    dropout: float = _DEFAULTS["dropout"]
    mixer_dropout: float = _DEFAULTS["mixer_dropout"]
    norm_eps: float = _DEFAULTS["norm_eps"]
    init_std: float = _DEFAULTS["init_std"]
    random_init_std: float = _DEFAULTS["random_init_std"]
    sgu_init_eps: float = _DEFAULTS["sgu_init_eps"]
    seed: int = _DEFAULTS["seed"]
    document_mask: bool = _DEFAULTS["document_mask"]
    eos_id: int | None = None

    # Hugging Face side. Tying the embedding to the head happens inside SynthesizerLM (no head tensor when tied),
    # so transformers must never tie anything itself; generation decodes incrementally (modeling_synthformer.py).
    tie_word_embeddings: bool = False
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        model_cfg = self.to_model_config()   # validates; fills d_ffn and factorized_a/b
        for name in ("d_ffn", "factorized_a", "factorized_b", "mixer"):
            setattr(self, name, getattr(model_cfg, name))

    def to_model_config(self) -> ModelConfig:
        """The ModelConfig these fields describe (a ConfigError names the first bad one)."""
        return ModelConfig.from_dict({name: getattr(self, name) for name in _DEFAULTS}, "config.json")
