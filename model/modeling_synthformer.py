"""SynthformerForCausalLM: a SynthesizerLM behind the Hugging Face `PreTrainedModel` + `GenerationMixin` interface.

The wrapper owns one `SynthesizerLM` as `self.model`, so its state-dict keys are `model.<canonical name>` and the
weights of a release load unchanged. It adds nothing to the math:

    logits = SynthesizerLM(input_ids)                                     (B, n, V)
    loss   = Head.loss(logits[:, :-1], labels[:, 1:])                     (labels == −100 ignored)

`generate()` here recomputes the last ≤ max_seq_len tokens at every step, the window of model/generate.py; the
incremental decoding of model/decoding.py (tools/generate.py) is not wired to transformers' cache interface yet.
This file ships inside every export (model/hf.py). transformers' loader copies the model files it reaches through
`from .x import` statements and does not see `from . import x`: parallel.py, which the model files import only that
way, is therefore imported here by name.
"""
from __future__ import annotations

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_synthformer import SynthformerConfig
from .lm import Head, SynthesizerLM
from .parallel import init_from_seed
from .synthesizers import Rotary


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
        return False   # each step recomputes the window (see the module docstring)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """The whole prefix every step, cut to the last max_seq_len tokens (position-indexed weights stop there)."""
        L = self.model.cfg.max_seq_len
        inputs = {"input_ids": input_ids[:, -L:]}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask[:, -L:]
        return inputs

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, return_dict: bool | None = None, **kwargs):
        """input_ids (B, n) → logits (B, n, V) [+ loss]. `past_key_values`, `use_cache` and other generation
        kwargs are accepted and ignored. Padding may only be on the right: a synthesized map mixes by position,
        so a left-padded row would put its tokens at the wrong positions and no mask can undo that."""
        if attention_mask is not None and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("Synthformer supports right padding only (attention_mask must not go 0 → 1); "
                             "use tokenizer.padding_side='right' or batch prompts of equal length")
        logits = self.model(input_ids)                                     # (B, n, V)
        loss = None if labels is None else Head.loss(logits[:, :-1], labels[:, 1:])
        if return_dict is False:
            return (logits,) if loss is None else (loss, logits)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
