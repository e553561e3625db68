"""ModelConfig: every field of a Synthesizer LM, validated where it is defined.

The YAML `model:` section maps one-to-one onto these fields (`ModelConfig.from_dict`). Errors are
`ConfigError`s: one line that names the field, the bad value and what to do.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from .fields import ConfigError, build, check_types
from .variants import parse_mixer, valid_mixer_names

# The mixer names a config may use are those registered in model/variants.py (their formulas: docs/DESIGN.md §1).
__all__ = ["ConfigError", "ModelConfig", "architecture_difference", "default_factorization", "parse_mixer", "plain",
           "valid_mixer_names"]


def default_factorization(L: int) -> tuple[int, int]:
    """The a·b = L split with a closest to √L (a ≤ b)."""
    a = max(d for d in range(1, math.isqrt(L) + 1) if L % d == 0)
    return a, L // a


@dataclass
class ModelConfig:
    """A GPT-style causal LM whose token mixer is a Synthesizer variant (Tay et al. 2020)."""

    vocab_size: int = field(metadata={"help": "token vocabulary size (must equal the tokenizer's)"})
    d_model: int = field(metadata={"help": "model width d"})
    n_layers: int = field(metadata={"help": "number of blocks"})
    n_heads: int = field(metadata={"help": "heads H per mixer; d_h = d/H; must divide by the TP size"})
    max_seq_len: int = field(metadata={"help": "L: the longest sequence; position-indexed weights have length L"})
    mixer: Any = field(default="dot", metadata={"help": "one mixer name for every layer, or a list with one per layer "
                                                "(the names: model/variants.py, docs/DESIGN.md §1)",
                                                "type": "str | list[str]"})
    factorized_k: int = field(default=8, metadata={"help": "rank k of factorized_random (R1, R2 ∈ R^{L×k})"})
    factorized_a: int | None = field(default=None, metadata={"help": "a of factorized_dense (a·b = L); default: a≈√L"})
    factorized_b: int | None = field(default=None, metadata={"help": "b of factorized_dense (a·b = L)"})
    impl: str = field(default="fused", metadata={"help": "'fused' (SDPA kernels) or 'reference' (materialized maps)"})
    block: str = field(default="standard", metadata={"help": "'standard' (norm, mixer, norm, MLP) or 'gmlp' (Liu et al. 2021)"})
    d_ffn: int | None = field(default=None, metadata={"help": "MLP / gMLP hidden width; default 4·d"})
    position: str = field(default="learned", metadata={"help": "'learned' absolute embedding, 'rope' (on dot q/k) or 'none'"})
    rope_base: float = field(default=10000.0, metadata={"help": "rotary base frequency"})
    tie_embeddings: bool = field(default=True, metadata={"help": "share the token embedding with the output head"})
    bias: bool = field(default=True, metadata={"help": "biases in linear layers"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on embeddings and residual branches"})
    mixer_dropout: float = field(default=0.0, metadata={"help": "dropout on each head's mixed output (TP-sharded)"})
    norm_eps: float = field(default=1e-5, metadata={"help": "LayerNorm epsilon"})
    init_std: float = field(default=0.02, metadata={"help": "std of normal init for weights"})
    random_init_std: float = field(default=1.0, metadata={"help": "std of the init of R (random, random_fixed)"})
    sgu_init_eps: float = field(default=1e-3, metadata={"help": "SGU spatial weights ~ U(-eps/L, eps/L), bias = 1"})
    seed: int = field(default=1234, metadata={"help": "init seed: the full model is drawn from it, each TP rank keeps its slice"})
    document_mask: bool = field(default=False, metadata={"help": "attend within each document only, positions "
                                "restarting at 0 after every eos (model/documents.py; docs/DESIGN.md §1)"})
    eos_id: int | None = field(default=None, metadata={"help": "the token that ends a document (the shards' manifest "
                               "eos_id); needed by document_mask"})

    def __post_init__(self):
        check_types(self, "model")

        def positive_int(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"model.{name}={v!r} must be a positive integer")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "factorized_k"):
            positive_int(name)
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                              "choose d_model = n_heads × head size")
        for name, allowed in (("impl", ("fused", "reference")), ("block", ("standard", "gmlp")),
                              ("position", ("learned", "rope", "none"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model.{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name in ("dropout", "mixer_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be in [0, 1)")
        if self.d_ffn is None:
            self.d_ffn = 4 * self.d_model
        positive_int("d_ffn")
        if isinstance(self.mixer, (list, tuple)):
            if len(self.mixer) != self.n_layers:
                raise ConfigError(f"model.mixer lists {len(self.mixer)} names but model.n_layers={self.n_layers}; "
                                  "give one name per layer or a single name")
            self.mixer = list(self.mixer)
        for i, name in enumerate(self.layer_mixers()):
            key = "model.mixer" if isinstance(self.mixer, str) else f"model.mixer[{i}]"
            parse_mixer(name, key)
        if self.block == "gmlp" and any(m != "sgu" for m in self.layer_mixers()):
            raise ConfigError("model.block='gmlp' needs model.mixer='sgu' (a gMLP block is its own mixer)")
        if self.block == "gmlp" and (self.d_ffn // 2) % self.n_heads:
            raise ConfigError(f"model.d_ffn/2={self.d_ffn // 2} must divide by model.n_heads={self.n_heads} for gMLP")
        self._check_factorization()
        if self.document_mask and self.eos_id is None:
            raise ConfigError("model.document_mask=true needs model.eos_id: set it to the eos_id of the shards' "
                              "manifest.json (the token that ends each document)")
        if self.eos_id is not None and not 0 <= self.eos_id < self.vocab_size:
            raise ConfigError(f"model.eos_id={self.eos_id} is not a token id below model.vocab_size={self.vocab_size}")

    def _check_factorization(self):
        L = self.max_seq_len
        if self.factorized_a is None and self.factorized_b is None:
            self.factorized_a, self.factorized_b = default_factorization(L)
        elif self.factorized_a is None or self.factorized_b is None:
            given = self.factorized_a or self.factorized_b
            if not isinstance(given, int) or given <= 0 or L % given:
                raise ConfigError(f"model.factorized_a/b={given!r} does not divide model.max_seq_len={L}; "
                                  "factorized_dense needs a·b = max_seq_len")
            other = L // given
            self.factorized_a, self.factorized_b = (given, other) if self.factorized_a else (other, given)
        if self.factorized_a * self.factorized_b != L:
            raise ConfigError(f"model.factorized_a·factorized_b = {self.factorized_a}·{self.factorized_b} = "
                              f"{self.factorized_a * self.factorized_b} ≠ model.max_seq_len={L}; "
                              "factorized_dense needs a·b = max_seq_len")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def layer_mixers(self) -> list[str]:
        """The mixer name of each layer."""
        return list(self.mixer) if isinstance(self.mixer, list) else [self.mixer] * self.n_layers

    @classmethod
    def from_dict(cls, d: dict, source: str = "the config") -> "ModelConfig":
        """Build from a `model:` mapping (YAML, a release's or an export's config.json); an unknown key names the
        nearest valid one, a missing one what it is."""
        return build(cls, d, "model", source)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def key(self) -> str:
        """The config as one string, `from_dict(json.loads(key))` its inverse: the key of the caches of work that
        depends on the config alone (shapes, parameters, FLOPs, the memory and time plans' per-layer terms)."""
        return json.dumps(self.to_dict(), sort_keys=True)


# Fields that may differ between a release and the run it starts: they change no tensor's meaning or shape.
FREE_MODEL_FIELDS = {"impl", "dropout", "mixer_dropout", "seed", "init_std", "random_init_std", "sgu_init_eps"}


def architecture_difference(theirs: dict, ours: dict) -> str | None:
    """The first model key (other than FREE_MODEL_FIELDS) whose value differs between two model-section dicts; a key
    that one of them lacks (saved before the field existed) counts as the field's default."""
    defaults = {f.name: f.default for f in fields(ModelConfig)}
    return next((k for k in ours if k not in FREE_MODEL_FIELDS
                 and plain(theirs.get(k, defaults.get(k))) != plain(ours[k])), None)


def plain(v: Any) -> Any:
    """Lists for tuples, at any depth: what a config looks like after a round trip through YAML or JSON."""
    return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v
