"""Downstream scores during training (logging.eval_tasks): lm-evaluation-harness tasks on the live weights.

    LiveLM(model, tokenizer, batch_size=32)   lm-eval's model over a SynthesizerLM in memory: the core of the
                                              `synthformer` model of evaluation/lm_eval_adapter.py, which loads one
                                              from a path; the same code scores a run during training and afterwards
    score(model, tokenizer, tasks, ...)       {"eval/<task>/<metric>": value} by lm_eval.simple_evaluate, offline,
                                              the repository's tasks/ included (any other lm-eval task works where
                                              its data is cached)

lm-eval is an optional extra (`pip install 'synthformer[eval]'`): the trainer imports this module only when a config
asks for scores. Under tensor parallelism every rank of the model's TP group runs the same requests in the same order
(each forward pass is collective) and the logits are gathered over the vocabulary; under PP rank 0 scores the joined
model (pretrain/train.py). See evaluation/lm_eval_adapter.py for the three request types' definitions.
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
from lm_eval.models.utils import normalize_gen_kwargs

from model import ConfigError
from model import parallel as tp
from model.generate import sample
from tokendata import tokenizer as tokenizers
from tokendata.remote import DataError

log = logging.getLogger(__name__)
NEWLINE_MODES = ("eos", "text")
NEWLINES = re.compile(r"\n+")   # training never saw an empty document, so a blank line is one boundary, not two
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository (pretrain/observe/..)
TASKS = os.path.join(ROOT, "tasks")   # the shipped tasks


def cut_at_stop(text: str, until: list[str]) -> str:
    """The text before the first occurrence of any stop string (lm-eval's HF model cuts the same way)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


class LiveLM(TemplateLM):
    """A SynthesizerLM already in memory, on its device and in its dtype, behind lm-eval's three request types."""

    def __init__(self, model, tokenizer: str, batch_size: int = 32, newline: str = "eos", rolling_context: int = 1,
                 max_gen_toks: int = 256, info: dict | None = None):
        super().__init__()
        if newline not in NEWLINE_MODES:
            raise ConfigError(f"model_args newline={newline!r} is not one of {', '.join(NEWLINE_MODES)}")
        self.batch_size, self.info = batch_size, info or {}
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
        self.model = model.eval()
        self._device = next(model.parameters()).device
        self._max_gen_toks = int(max_gen_toks)

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
    @torch.no_grad()
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
            logits = tp.gather_last_dim(self.model(x.to(self.device)))                 # (B, n, V)
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

    @torch.no_grad()
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


def metric_name(task: str, key: str) -> str:
    """lm-eval's result key ('acc,none', 'acc_norm,none', 'exact_match,strict-match') as `eval/<task>/<metric>`."""
    metric, _, filt = key.partition(",")
    return f"eval/{task}/{metric}" + (f"_{filt}" if filt and filt != "none" else "")


def score(model, tokenizer: str, tasks: list[str], batch_size: int = 32, limit: int | None = None,
          include_path: str = TASKS) -> dict[str, float]:
    """{"eval/<task>/<metric>": value} of lm-eval's `tasks` on `model` as it is now (its weights, device, dtype):
    the numbers lm_eval.simple_evaluate reports (without standard errors, see below); `limit` the first documents of
    each task (lm-eval's limit). {} on every process but the one lm-eval reports on (LOCAL_RANK 0)."""
    import lm_eval

    lm = LiveLM(model, tokenizer, batch_size)
    # No seeding of Python's, numpy's or torch's global generators: they are the trainer's (dropout, exact resume).
    # No bootstrapped standard errors: lm-eval computes them in a forked process pool, and a training process (gloo's
    # and the data loader's threads) cannot be forked safely.
    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=limit, log_samples=False, verbosity="ERROR",
                                  task_manager=task_manager(include_path, tuple(tasks)), random_seed=None,
                                  numpy_random_seed=None, torch_random_seed=None, bootstrap_iters=0)
    if out is None:   # lm-eval reports on the process with LOCAL_RANK 0 only; the others ran the same passes
        return {}
    return {metric_name(task, key): float(value) for task, metrics in out["results"].items()
            for key, value in metrics.items() if "," in key and isinstance(value, (int, float))}   # "metric,filter"


_MANAGERS: dict = {}


def task_manager(include_path: str, tasks: tuple[str, ...]):
    """lm-eval's TaskManager over `include_path`, and over lm-eval's own thousands of tasks only where a task is not
    found there (indexing them takes seconds); kept for the run's later evaluations."""
    from lm_eval.tasks import TaskManager

    local = TaskManager(include_path=include_path, include_defaults=False)
    defaults = not set(tasks) <= set(local.all_tasks)
    key = (include_path, defaults)
    if key not in _MANAGERS:
        _MANAGERS[key] = TaskManager(include_path=include_path) if defaults else local
    return _MANAGERS[key]
