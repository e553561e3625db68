"""A model from any form it is kept in, for the evaluation and generation commands.

    load(path, tokenizer=None)   (model at TP=1 in eval mode, its tokenizer (tokendata/tokenizer.py: sentencepiece
                                 or Hugging Face), {"source", "step"}) from a release, a DeepSpeed run / checkpoints /
                                 step_* directory (also in a bucket: s3://bucket/prefix[/step_*]), or a Hugging
                                 Face export
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import sys
import tempfile

from cli import UsageError
from model import ConfigError
from model.release import find_tokenizer
from pretrain.checkpoints import load_any
from pretrain.checkpoints.bucket import is_bucket, local_checkpoint
from tokendata import tokenizer as tokenizers
from tokendata.remote import DataError


def is_hf_export(path: str) -> bool:
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return json.load(f).get("model_type") == "synthformer"


def load_hf(path: str):
    """(SynthesizerLM, tokenizer path, info) of a Hugging Face export, loaded by transformers itself (remote code)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    step = (getattr(hf.config, "synthformer_training", None) or {}).get("step", 0)
    # The SynthesizerLM inside, in the export's own code and with the weights transformers loaded: the tools need
    # its parts (cached decoding), not only its logits.
    return hf.model, find_tokenizer(path), {"source": path, "step": step}


def local(path: str) -> str:
    """A checkpoint path as a local one: a checkpoint in a bucket (s3://bucket/prefix[/step_*]; credentials from the
    backend's own settings, e.g. AWS_*) is downloaded into a temporary directory removed when the process exits."""
    if not is_bucket(path):
        return path
    staging = tempfile.mkdtemp(prefix="synthformer-checkpoint-")
    atexit.register(shutil.rmtree, staging, True)
    try:
        return local_checkpoint(path, staging)
    except (ConfigError, DataError) as e:
        raise UsageError(str(e)) from None


def load(path: str, tokenizer: str | None = None, need_tokenizer: bool = True):
    """(model in eval mode at TP=1, tokenizer or None, info {"source", "step"}); UsageError otherwise. `path` may be
    in a bucket (`local`)."""
    path = local(path)
    if not os.path.exists(path):
        raise UsageError(f"checkpoint {path} does not exist: pass a release directory or a DeepSpeed run/checkpoint")
    try:
        with contextlib.redirect_stdout(sys.stderr):   # DeepSpeed's import banner must not corrupt --json output
            model, found, info = load_hf(path) if is_hf_export(path) else load_any(path)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    except (OSError, RuntimeError, ValueError, KeyError) as e:   # a truncated or foreign file
        raise UsageError(f"cannot read checkpoint {path}: {str(e).strip().splitlines()[0]}") from None
    tokenizer = tokenizer or found
    if tokenizer is None:
        if need_tokenizer:
            raise UsageError(f"{info['source']} holds no tokenizer (tokenizer.model or tokenizer.json): pass "
                             "--tokenizer PATH")
        return model, None, info
    try:
        sp = tokenizers.load(tokenizer)
    except DataError as e:
        raise UsageError(str(e)) from None
    if sp.vocab_size() > model.cfg.vocab_size:   # fewer is padding of the model's vocabulary (model.vocab_size)
        raise UsageError(f"tokenizer {tokenizer} has {sp.vocab_size()} ids but the model's vocab_size is "
                         f"{model.cfg.vocab_size}: pass the tokenizer the model was trained with (--tokenizer)")
    return model, sp, info
