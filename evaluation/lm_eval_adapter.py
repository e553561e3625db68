"""The lm-eval model `synthformer`: a Synthformer release or DeepSpeed checkpoint scored by lm-evaluation-harness.

    import evaluation.lm_eval_adapter                      # registers "synthformer" (lm-eval reads no entry points)
    lm_eval.simple_evaluate(model="synthformer", model_args="path=runs/demo-release,batch_size=16", tasks=[...])

model_args (key=value, comma-separated):
    path=DIR           release directory, run directory, its checkpoints/ or a step_* directory (required)
    tokenizer=PATH     the run's tokenizer (tokenizer.model or tokenizer.json), when the checkpoint holds none
    batch_size=N       sequences per forward pass (auto → 32); device=cpu|cuda|cuda:N; dtype=float32|bfloat16
    newline=eos|text   eos (default): every line is a document, as tools/make_shards.py streams the corpus
                       (line ids, eos, line ids, ...); text: a newline is encoded like any character
    rolling_context=C  context carried into each later window of loglikelihood_rolling (default 1, as lm-eval's HF
                       model: disjoint windows of L tokens; C = L/2 gives every prediction ≥ L/2 tokens of context)
    max_gen_toks=N     default generation budget of generate_until (a task's max_gen_toks wins)

With L = model.cfg.max_seq_len and p the model's next-token softmax:
    loglikelihood(c, y)     = Σ_t log p(y_t | c, y_<t), one forward over (c + y)[-(L+1):][:-1] (y longer than L:
                              blocks of L, each seeing the L tokens before its end), and is_greedy = every y_t is
                              the argmax; the context loses its oldest tokens past L
    loglikelihood_rolling(x) = Σ_t log p(x_t | x_<t) over every token of x exactly once, x_0 conditioned on eos (the
                              document boundary of training), in windows from lm_eval.utils.get_rolling_token_windows
    generate_until(c, kw)   = model/generate.py's `sample` one token at a time (argmax unless do_sample), stopped at
                              eos, at max_gen_toks or when an `until` string appears; the text is cut before it.
Batches are right-padded: the model is causal, so pads after a sequence do not change its logits. Single process only
(no data-parallel ranks); one device. The requests are answered by pretrain/observe/downstream.py's LiveLM, which the trainer
also uses to score its live weights during training (logging.eval_tasks); this class loads the model from a path.
"""
from __future__ import annotations

import logging
import os

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.registry import register_model

from model import ConfigError
from pretrain.checkpoints import load_any
from pretrain.observe.downstream import LiveLM

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
AUTO_BATCH_SIZE = 32        # no memory probing on CPU; a fixed size that suits the small models of this repository


def parse_batch_size(value) -> int:
    if isinstance(value, str) and value.startswith("auto"):
        log.info("synthformer: batch_size=%s -> %d (no automatic search)", value, AUTO_BATCH_SIZE)
        return AUTO_BATCH_SIZE
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise ConfigError(f"model_args batch_size={value!r} must be a positive integer or 'auto'")
    return n


def resolve_device(device) -> torch.device:
    """The requested device; cuda without CUDA falls back to cpu (lm-eval's CLI asks for cuda:0 unless told)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        log.warning("synthformer: device=%s but CUDA is not available; running on cpu", device)
        return torch.device("cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ConfigError(f"model_args device={device!r} is not a torch device; use cpu, cuda or cuda:N") from None


@register_model("synthformer")
class SynthformerLM(LiveLM):
    """A SynthesizerLM (fp32 at TP=1 from pretrain.checkpoints.load_any) behind lm-eval's three request types."""

    def __init__(self, path=None, tokenizer=None, batch_size=1, device=None, dtype="float32", newline="eos",
                 rolling_context=1, max_gen_toks=256, max_batch_size=None, **unused):
        if not path:
            raise ConfigError("model_args path=DIR is missing: give a release directory or a DeepSpeed checkpoint "
                              "(run directory, its checkpoints/ or a step_* directory)")
        if dtype not in DTYPES:
            raise ConfigError(f"model_args dtype={dtype!r} is not one of {', '.join(DTYPES)}")
        if unused:
            log.warning("synthformer: ignoring model_args %s", ", ".join(sorted(unused)))
        batch_size = parse_batch_size(batch_size)   # the cheap checks before a checkpoint is read
        model, found_tokenizer, info = load_any(str(path))
        tokenizer = tokenizer or found_tokenizer
        if not tokenizer:
            raise ConfigError(f"{path} holds no tokenizer (tokenizer.model or tokenizer.json); pass model_args "
                              f"tokenizer=PATH (the tokenizer the run trained with)")
        if not os.path.isfile(tokenizer):
            raise ConfigError(f"model_args tokenizer={tokenizer} does not exist; pass the run's tokenizer.model")
        model = model.to(device=resolve_device(device), dtype=DTYPES[dtype])
        super().__init__(model, tokenizer, batch_size, newline, rolling_context, max_gen_toks, info)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """model_args win over simple_evaluate's batch_size/device (lm-eval's CLI always passes them: 1, cuda:0);
        lm-eval's own version would fail on a key given in both."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)
