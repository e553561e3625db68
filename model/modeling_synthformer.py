"""SynthformerForCausalLM: a SynthesizerLM behind the Hugging Face `PreTrainedModel` + `GenerationMixin` interface.

The wrapper owns one `SynthesizerLM` as `self.model`, so its state-dict keys are `model.<canonical name>` and the
weights of a release load unchanged. It adds nothing to the math:

    logits = SynthesizerLM(input_ids)                                     (B, n, V)
    loss   = Head.loss(logits[:, :-1], labels[:, 1:])                     (labels == −100 ignored)

`generate()` decodes incrementally through transformers' cache interface: `SynthformerCache` (a `Cache`) holds, per
layer, the per-position tensors of model/decoding.py (values, the keys of dot members, LN(Z2) of SGU), so each step
computes its new position only, exactly as the full recompute would (tools/generate.py decodes the same way).
Positions are absolute and stop at max_seq_len L: once the sequence outgrows L, every step hands the model its last
L tokens, which shifts every position, so the cache restarts and that step recomputes the window — what
model/generate.py does, and what `use_cache=False` does at every step.
This file ships inside every export (model/hf.py). transformers' loader copies the model files it reaches through
`from .x import` statements and does not see `from . import x`: parallel.py, which the model files import only that
way, is therefore imported here by name.
"""
from __future__ import annotations

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_synthformer import SynthformerConfig
from .decoding import LayerCache, documents_so_far
from .lm import Head, SynthesizerLM
from .parallel import init_from_seed
from .synthesizers import Rotary


class SynthformerCache(Cache):
    """The cache of a Synthformer: per layer a model/decoding.py LayerCache (the per-position tensors of positions
    0 … t−1, each (B, …, L, f)), and t = get_seq_length(); under model.document_mask also the tokens of those
    positions (their documents mask the new ones). At most L = max_seq_len positions; see the module docstring for
    what happens past L."""

    def __init__(self, n_layers: int, max_seq_len: int):
        super().__init__(layers=[])
        self.n_layers, self.max_seq_len = n_layers, max_seq_len
        self.reset()

    def reset(self) -> None:
        self.t, self.layer_caches = 0, [LayerCache(self.max_seq_len) for _ in range(self.n_layers)]
        self.tokens = None

    def __len__(self) -> int:
        return self.n_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.t

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_seq_len

    @property
    def is_compileable(self) -> bool:   # its buffers grow in Python: generate() must not torch.compile around it
        return False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: every cached tensor is per sample (batch first)."""
        for layer in self.layer_caches:
            for name, buffer in layer.buffers.items():
                layer.buffers[name] = buffer.index_select(0, beam_idx.to(buffer.device))
        if self.tokens is not None:
            self.tokens = self.tokens.index_select(0, beam_idx.to(self.tokens.device))


class SynthformerForCausalLM(PreTrainedModel, GenerationMixin):
    """input_ids (B, n) → logits (B, n, V) of the wrapped SynthesizerLM (TP=1); loss when labels are given."""

    config_class = SynthformerConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = None   # tying, when configured, lives inside SynthesizerLM (head is None)

    def __init__(self, config: SynthformerConfig):
        super().__init__(config)
        self.model = SynthesizerLM(config.to_model_config())
        self._frozen = {name for name, p in self.named_parameters() if not p.requires_grad}   # random_fixed's R
        if not any(p.is_meta for p in self.model.parameters()):
            # A model built from a config alone starts exactly as model.build_model would draw it; from_pretrained
            # builds on the meta device and loads every tensor instead. Flagged so HF's init leaves them alone.
            init_from_seed(self.model, config.seed)
            for p in self.model.parameters():
                p._is_hf_initialized = True
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """PreTrainedModel.from_pretrained, then re-freezes what the model keeps fixed (random_fixed's R): loading
        replaces every parameter with a new, trainable one, which fine-tuning would otherwise update."""
        model = super().from_pretrained(*args, **kwargs)
        for name, p in model.named_parameters():
            if name in model._frozen:
                p.requires_grad_(False)
        return model

    @torch.no_grad()
    def _init_weights(self, module):
        """Only the non-persistent RoPE tables need filling after a load (they are not in the checkpoint and come
        back from the meta device uninitialised); every parameter is either loaded or drawn in __init__."""
        if isinstance(module, Rotary):
            cfg = self.model.cfg
            fresh = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
            module.cos = fresh.cos.to(module.cos.device)
            module.sin = fresh.sin.to(module.sin.device)

    def get_input_embeddings(self):
        return self.model.wte

    def set_input_embeddings(self, value):
        self.model.wte = value

    def get_output_embeddings(self):
        return self.model.head   # None when tied: HF then has nothing to tie or resize separately

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False   # no DynamicCache: prepare_inputs_for_generation brings a SynthformerCache

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, use_cache=True,
                                      **kwargs):
        """The positions the cache has not seen, with the cache; once the sequence outgrows L, its last L tokens
        and a restarted cache (position-indexed weights stop at L). Without a cache: the last ≤ L tokens."""
        L, n = self.model.cfg.max_seq_len, input_ids.shape[1]
        inputs = {"input_ids": input_ids[:, -L:], "use_cache": bool(use_cache)}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask[:, -L:]
        if use_cache:
            cache = past_key_values if isinstance(past_key_values, SynthformerCache) else \
                SynthformerCache(len(self.model.blocks), L)
            if n > L or cache.t >= n:   # the window slid (every position shifted), or a new sequence
                cache.reset()
            inputs.update(input_ids=inputs["input_ids"][:, cache.t:], past_key_values=cache)
        return inputs

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, past_key_values: SynthformerCache | None = None,
                use_cache: bool | None = None, return_dict: bool | None = None, **kwargs):
        """input_ids (B, m) → logits (B, m, V) [+ loss]. With a cache (`past_key_values`, or `use_cache=True`, which
        starts one), input_ids are positions t … t+m−1 after the t the cache holds, and the output carries the
        extended cache. Padding may only be on the right: a synthesized map mixes by position, so a left-padded
        row would put its tokens at the wrong positions and no mask can undo that."""
        if attention_mask is not None and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("Synthformer supports right padding only (attention_mask must not go 0 → 1); "
                             "use tokenizer.padding_side='right' or batch prompts of equal length")
        cache = past_key_values
        if cache is None and use_cache:
            cache = SynthformerCache(len(self.model.blocks), self.model.cfg.max_seq_len)
        logits = self.model(input_ids) if cache is None else self._cached_logits(input_ids, cache)   # (B, m, V)
        loss = None if labels is None else Head.loss(logits[:, :-1], labels[:, 1:])
        if return_dict is False:
            return tuple(x for x in (loss, logits, cache) if x is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)

    def _cached_logits(self, input_ids, cache: SynthformerCache):
        """Rows t0 … t0+m−1 of the model's logits over all positions so far, computed from the cache (model/lm.py
        Block.forward with t0 and a LayerCache, as model/decoding.py's IncrementalDecoder)."""
        m, t0, L = input_ids.shape[1], cache.t, cache.max_seq_len
        if self.training:
            raise ValueError("a cache needs model.eval(): dropout would differ from the cached steps")
        if t0 + m > L:
            raise ValueError(f"{t0 + m} positions exceed max_position_embeddings={L}: start a new cache with the "
                             f"last {L} tokens")
        cache.tokens, docs = documents_so_far(self.model, cache.tokens, input_ids)   # None unless document_mask
        x = self.model.embed(input_ids, t0, docs)                          # (B, m, d)
        for block, layer in zip(self.model.blocks, cache.layer_caches):
            x = block(x, t0=t0, cache=layer, docs=docs)
        cache.t = t0 + m
        return self.model.logits(x)
