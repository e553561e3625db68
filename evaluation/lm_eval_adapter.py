"""The lm-eval model `synthformer`: a Synthformer release or DeepSpeed checkpoint scored by lm-evaluation-harness.

    import evaluation.lm_eval_adapter                      # registers "synthformer" (lm-eval reads no entry points)
    lm_eval.simple_evaluate(model="synthformer", model_args="path=runs/demo-release,batch_size=16", tasks=[...])

model_args (key=value, comma-separated):
    path=DIR           release directory, run directory, its checkpoints/ or a step_* directory (required)
    tokenizer=PATH     the run's tokenizer (tokenizer.model or tokenizer.json), when the checkpoint holds none
    batch_size=N       sequences per forward pass (auto → 32); device=cpu|cuda|cuda:N; dtype=float32|bfloat16
    newline=eos|text   eos (default): every line is a document, as tools/make_shards.py streams the corpus
                       (line ids, eos, line ids, ...); text: a newline is encoded like any character (the
                       layout of shards made from records whose documents keep their newlines: JSONL, Parquet…)
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
(no data-parallel ranks); one device.
"""
from __future__ import annotations

import logging
import os
import re

import torch
import torch.nn.functional as F
from tqdm import tqdm

import lm_eval.models  # noqa: F401 -- built-in model names first: lm-eval imports them only while its registry is empty
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs

from model import ConfigError
from model.generate import sample
from pretrain.checkpoints import load_any
from tokendata import tokenizer as tokenizers
from tokendata.remote import DataError

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NEWLINE_MODES = ("eos", "text")
AUTO_BATCH_SIZE = 32        # no memory probing on CPU; a fixed size that suits the small models of this repository
NEWLINES = re.compile(r"\n+")   # training never saw an empty document, so a blank line is one boundary, not two


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


def cut_at_stop(text: str, until: list[str]) -> str:
    """The text before the first occurrence of any stop string (lm-eval's HF model cuts the same way)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


@register_model("synthformer")
class SynthformerLM(TemplateLM):
    """A SynthesizerLM (fp32 at TP=1 from pretrain.checkpoints.load_any) behind lm-eval's three request types."""

    def __init__(self, path=None, tokenizer=None, batch_size=1, device=None, dtype="float32", newline="eos",
                 rolling_context=1, max_gen_toks=256, max_batch_size=None, **unused):
        super().__init__()
        if not path:
            raise ConfigError("model_args path=DIR is missing: give a release directory or a DeepSpeed checkpoint "
                              "(run directory, its checkpoints/ or a step_* directory)")
        if dtype not in DTYPES:
            raise ConfigError(f"model_args dtype={dtype!r} is not one of {', '.join(DTYPES)}")
        if newline not in NEWLINE_MODES:
            raise ConfigError(f"model_args newline={newline!r} is not one of {', '.join(NEWLINE_MODES)}")
        if unused:
            log.warning("synthformer: ignoring model_args %s", ", ".join(sorted(unused)))
        self.batch_size = parse_batch_size(batch_size)   # the cheap checks before a checkpoint is read
        model, found_tokenizer, self.info = load_any(str(path))
        tokenizer = tokenizer or found_tokenizer
        if not tokenizer:
            raise ConfigError(f"{path} holds no tokenizer (tokenizer.model or tokenizer.json); pass model_args "
                              f"tokenizer=PATH (the tokenizer the run trained with)")
        if not os.path.isfile(tokenizer):
            raise ConfigError(f"model_args tokenizer={tokenizer} does not exist; pass the run's tokenizer.model")
        try:
            self.sp = tokenizers.load(str(tokenizer))
        except DataError as e:
            raise ConfigError(str(e)) from None
        L, V = model.cfg.max_seq_len, model.cfg.vocab_size
        if self.sp.vocab_size() > V or self.sp.eos_id() < 0:
            raise ConfigError(f"tokenizer {tokenizer} ({self.sp.vocab_size()} pieces, eos id {self.sp.eos_id()}) does "
                              f"not fit the model (vocab_size={V}) or has no eos; pass the run's tokenizer.model")
        try:
            rolling_context = int(rolling_context)
        except (TypeError, ValueError):
            rolling_context = 0
        if not 1 <= rolling_context <= L:
            raise ConfigError(f"model_args rolling_context={rolling_context!r} must be in [1, max_seq_len={L}]")
        self.tokenizer_path, self.newline, self.rolling_context = str(tokenizer), newline, rolling_context
        self._device = resolve_device(device)
        self.model = model.to(device=self._device, dtype=DTYPES[dtype]).eval()
        self._max_gen_toks = int(max_gen_toks)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """model_args win over simple_evaluate's batch_size/device (lm-eval's CLI always passes them: 1, cuda:0);
        lm-eval's own version would fail on a key given in both."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    # ---- what lm-eval asks of a model ------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.sp.eos_id()

    @property
    def max_length(self) -> int:
        return self.model.cfg.max_seq_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer_path

    # ---- text <-> ids ----------------------------------------------------------------------------------------------
    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        """ids without BOS; with newline=eos each line is encoded on its own and lines are joined by eos."""
        if self.newline == "text":
            return self.sp.encode(string)
        ids = []
        for k, line in enumerate(NEWLINES.split(string)):
            if k:
                ids.append(self.eot_token_id)
            if line:
                ids.extend(self.sp.encode(line))
        return ids

    def tok_decode(self, ids: list[int], continuation: bool = False) -> str:
        """Inverse of tok_encode. continuation=True: the ids go on a line already started, so a leading '▁' is a
        space (sentencepiece's decode drops it, taking it for the dummy prefix that starts every encoded line; a
        Hugging Face tokenizer's Metaspace decoder the same)."""
        lines = [[]]
        for i in ids:
            if i == self.eot_token_id and self.newline == "eos":
                lines.append([])
            else:
                lines[-1].append(i)
        text = [self.sp.decode(line) for line in lines]
        if continuation and lines[0] and self.sp.word_start(lines[0][0]) and not text[0].startswith(" "):
            text[0] = " " + text[0]
        return "\n".join(text)

    # ---- loglikelihood ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """[(cache key or None, context ids, continuation ids)] → [(Σ log p(continuation), is_greedy)].

        A continuation is scored in blocks of ≤ L tokens, each predicted from the L tokens before the block's end
        (one block unless the continuation is longer than L); the context loses its oldest tokens past that.
        Longest inputs first, so a batch is padded to its first row and the slowest batches come first."""
        L, eos = self.max_length, self.eot_token_id
        rows = []   # (request, input ids, targets): the last len(targets) inputs predict the targets
        for r, (_, context, continuation) in enumerate(requests):
            if not context:
                raise ConfigError("a loglikelihood request has no context token; lm-eval gives eos for an empty one")
            seq = list(context) + list(continuation)
            for a in range(len(context), len(seq), L):
                b = min(a + L, len(seq))
                rows.append((r, seq[max(0, b - 1 - L):b - 1], seq[a:b]))
        sums, greedy = [0.0] * len(requests), [True] * len(requests)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][1]))
        size = override_bs or self.batch_size
        for start in tqdm(range(0, len(order), size), desc="synthformer loglikelihood", disable=disable_tqdm,
                          unit="batch"):
            batch = [rows[i] for i in order[start:start + size]]
            x = torch.full((len(batch), len(batch[0][1])), eos, dtype=torch.long)     # (B, n)
            for b, (_, inp, _) in enumerate(batch):
                x[b, :len(inp)] = torch.tensor(inp)
            logits = self.model(x.to(self.device))                                     # (B, n, V)
            for b, (r, inp, targets) in enumerate(batch):
                # position t predicts token t+1: the last len(targets) positions predict the targets
                logp = F.log_softmax(logits[b, len(inp) - len(targets):len(inp)].float(), dim=-1)   # (k, V)
                target = torch.tensor(targets, device=logp.device)
                sums[r] += logp.gather(-1, target[:, None]).sum().item()
                greedy[r] = greedy[r] and bool((logp.argmax(-1) == target).all())
        results = list(zip(sums, greedy))
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Σ log p over every token of each text: lm-eval's rolling windows (each token predicted once, the first
        from the eos prefix), made disjoint into (context, continuation) pairs and scored in batches."""
        windows, owner = [], []
        for r, req in enumerate(requests):
            pairs = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(req.args[0]),
                                                       prefix_token=self.prefix_token_id,
                                                       max_seq_len=self.max_length, context_len=self.rolling_context)
            for context, continuation in map(lm_utils.make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owner.append(r)
        totals = [0.0] * len(requests)
        for r, (ll, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[r] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ---- generation ------------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Batches requests whose contexts have the same token length and the same generation kwargs: without an
        attention mask, padding a prompt would shift its positions."""
        groups: dict[tuple, list[tuple[int, list[int]]]] = {}
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args[0], req.args[1]
            ids = self.tok_encode(context) or [self.prefix_token_id]
            groups.setdefault((len(ids), repr(sorted(gen_kwargs.items()))), []).append((i, ids))
        out = [None] * len(requests)
        with tqdm(total=len(requests), desc="synthformer generate_until", disable=disable_tqdm) as bar:
            for members in groups.values():
                gen_kwargs = requests[members[0][0]].args[1]
                for start in range(0, len(members), self.batch_size):
                    chunk = members[start:start + self.batch_size]
                    for (i, _), text in zip(chunk, self._generate([ids for _, ids in chunk], gen_kwargs)):
                        out[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(len(chunk))
        return out

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], gen_kwargs: dict) -> list[str]:
        """Continuations of equal-length prompts, each stopped at eos or at its first `until` string."""
        kw = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until, budget = kw.pop("until"), kw.pop("max_gen_toks")
        temperature = float(kw.pop("temperature", 0.0)) if kw.pop("do_sample", False) else 0.0   # 0: argmax
        top_k, top_p, seed = kw.pop("top_k", None), kw.pop("top_p", None), int(kw.pop("seed", 0))
        if kw:
            log.warning("synthformer: ignoring generation kwargs %s", ", ".join(sorted(kw)))
        tokens = torch.tensor(prompts, dtype=torch.long, device=self.device)   # (B, t)
        t, active, texts = tokens.shape[1], list(range(len(prompts))), [""] * len(prompts)
        for step in range(budget):
            # one token at a time through the project's sampler; seed + step: a fresh draw at every step
            tokens = sample(self.model, tokens, 1, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + step)
            keep = []
            for row, i in enumerate(active):
                new = tokens[row, t:].tolist()
                ended = new[-1] == self.eot_token_id
                texts[i] = self.tok_decode(new[:-1] if ended else new, continuation=True)
                if not (ended or any(stop and stop in texts[i] for stop in until)):
                    keep.append(row)
            active = [active[row] for row in keep]
            if not active:
                break
            tokens = tokens[keep]   # finished rows leave the batch
        return [cut_at_stop(text, until) for text in texts]
