"""Build the local lm-eval tasks <prefix>_cloze and <prefix>_mc4 from held-out text (deterministic for a --seed).

    python tools/make_tasks.py --shards build/demo/shards --out tasks          # exactly the shipped tasks/austen_*
    python tools/make_tasks.py --input heldout.txt.gz --out /tmp/t --prefix mine --cloze-items 100 --mc-items 100

Held-out text comes from one of
  --shards DIR   the samples of one split (--split, default val) of a tools/make_shards.py directory, decoded with the
                 directory's tokenizer: a model trained on that directory never trained on them (the trainer reads
                 only the train split). Each sample's first token is dropped (it is also the last target of the
                 previous sample in the stream) and its text starts at the next whole word; eos ids become line
                 breaks (one paragraph per line, as in the corpus).
  --input FILE   text files, one paragraph per line (plain or .gz), cut into passages of whole paragraphs of at
                 least --passage-words words.

Items:
  <prefix>_cloze  LAMBADA-style (like lambada_openai): context = a passage up to the last word of one of its
                  sentences, target = that word (letters only; the sentence's final punctuation is dropped); lm-eval
                  scores acc (the greedy continuation is exactly " word": loglikelihood's is_greedy) and perplexity.
  <prefix>_mc4    context = a passage up to one of its sentences (sep: " " inside a paragraph, "\\n" before a new
                  one); choices = that sentence and three complete sentences of other passages, drawn from the
                  12 closest to it in length (characters), in a seeded order; lm-eval scores acc and acc_norm.
Each needs ≥ --min-context-words words of context; at most --per-passage items of a task come from one passage;
--cloze-items / --mc-items are drawn with --seed from all candidates and written in passage order.

Writes into --out: <prefix>_cloze.jsonl, <prefix>_mc4.jsonl, <prefix>_cloze.yaml, <prefix>_mc4.yaml (the source and
this command in their header) and local_data.py, a copy of tasks/local_data.py that loads the JSONL files relative
to the yaml from any working directory. Use them with lm-eval's --include_path DIR (tools/run_lm_eval.py includes tasks/).
"""
import argparse
import json
import os
import random
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass

from tqdm import tqdm

from cli import UsageError, one_line_errors
from cli.remote_args import add_remote_arguments, configure_remote
from tokendata import tokenizer as tokenizers
from tokendata.corpus import check_inputs, iter_documents
from tokendata.shards import read_manifest, shard_samples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEIGHBOURS = 12   # distractors are drawn from this many sentences closest in length to the true one
LOADER = os.path.join(ROOT, "tasks", "local_data.py")
CLOSERS = "\"'’”)\\]_"
# a sentence ends at . ! ? (and closing quotes/brackets) before whitespace and a capital, maybe after an opening quote
SENTENCE_END = re.compile(rf"[.!?][{CLOSERS}]*(?=\s+[\"'‘“(\[_]*[A-Z])")
COMPLETE = re.compile(rf"[.!?][{CLOSERS}]*$")
FINAL_WORD = re.compile(rf"(?<= )([A-Za-z]{{2,}})[.!?][{CLOSERS}]*$")   # a whole word right before the final stop
ABBREVIATIONS = {"Mr", "Mrs", "Dr", "St", "Messrs", "Col", "Capt", "Rev", "Gen", "Lieut", "Esq", "Sept", "Oct", "Nov",
                 "Dec", "Jan", "Feb", "Aug"}


@dataclass
class Sentence:
    passage: int     # index of its passage
    start: int       # character span in the passage text
    end: int
    first: bool      # first sentence of its paragraph
    clean_start: bool  # starts at a real sentence start (not the cut-off head of a passage)
    complete: bool     # ends with its final punctuation (not cut off by the end of the passage)


def abbreviated(text: str) -> bool:
    """The text ends with an abbreviation or an initial and its period: no sentence end."""
    word = re.search(r"(\w+)\.$", text.rstrip(CLOSERS))
    return bool(word) and (word.group(1) in ABBREVIATIONS or bool(re.fullmatch(r"[A-Z]", word.group(1))))


def split_sentences(text: str, passage: int, clean_head: bool) -> list[Sentence]:
    """Sentences of a passage (paragraphs separated by '\\n'); clean_head: its first paragraph starts cleanly."""
    out, offset = [], 0
    for k, par in enumerate(text.split("\n")):
        start = 0
        ends = []
        for m in SENTENCE_END.finditer(par):
            if not abbreviated(par[:m.end()]):   # "Mr. Darcy", "J. Smith" go on
                ends.append(m.end())
        for j, end in enumerate(ends + [len(par)]):
            if start < end:
                piece = par[start:end]
                out.append(Sentence(passage, offset + start, offset + end, j == 0, k > 0 or j > 0 or clean_head,
                                    bool(COMPLETE.search(piece)) and not abbreviated(piece)))
            start = end + len(par[end:]) - len(par[end:].lstrip())
        offset += len(par) + 1
    return out


def read_shard_passages(shard_dir: str, split: str, progress: bool = True):
    """([(name, text, clean_head)], description) of one split of a make_shards directory, decoded."""
    path = os.path.join(shard_dir, "manifest.json")
    if not os.path.isfile(path):
        raise UsageError(f"{path} not found: --shards needs a tools/make_shards.py output directory")
    with open(path) as f:
        manifest = json.load(f)
    if split not in manifest["splits"] or not manifest["splits"][split]["samples"]:
        raise UsageError(f"{shard_dir} has no samples in split '{split}'; pick --split train or val")
    tokenizer = os.path.join(shard_dir, manifest["tokenizer"])
    if not os.path.isfile(tokenizer):
        raise UsageError(f"{tokenizer} not found: the shard directory lost its tokenizer copy; rerun make_shards.py")
    sp, eos = tokenizers.load(tokenizer), manifest["eos_id"]
    manifest = read_manifest(shard_dir)
    passages = []
    with tqdm(total=manifest["splits"][split]["samples"], desc=f"decoding {split}", disable=not progress,
              file=sys.stderr) as bar:
        for shard in manifest["splits"][split]["shards"]:
            for key, tokens in shard_samples(manifest, shard):
                lines = [[]]
                for i in tokens.tolist()[1:]:
                    if i == eos:
                        lines.append([])
                    else:
                        lines[-1].append(i)
                head = lines[0]
                text = [sp.decode(line) for line in lines]
                if head and not sp.word_start(head[0]):   # starts inside a word: skip it
                    text[0] = text[0].split(" ", 1)[1] if " " in text[0] else ""
                paragraphs = [t.strip() for t in text if t.strip()]
                if paragraphs:
                    passages.append((key, "\n".join(paragraphs), not head))
                bar.update(1)
    m = manifest
    about = (f"the {m['splits'][split]['samples']} '{split}' samples of {shard_dir} (tools/make_shards.py: "
             f"{m['seq_len']}-token samples, each sent to val by a coin flip with seed {m['seed']}, P(val) = "
             f"{m['val_fraction']}), decoded with its tokenizer (sha256 {m['tokenizer_sha256'][:16]}...): text that "
             f"a model trained on {shard_dir} never trained on")
    return passages, about


def read_text_passages(paths: list[str], passage_words: int, progress: bool = True):
    """([(name, text, True)], description): whole paragraphs grouped until a passage has ≥ passage_words words."""
    check_inputs(paths)
    passages, current, words = [], [], 0
    for doc in iter_documents(paths, progress=progress):
        current.append(doc)
        words += len(doc.split())
        if words >= passage_words:
            passages.append((f"passage-{len(passages):06d}", "\n".join(current), True))
            current, words = [], 0
    if current:
        passages.append((f"passage-{len(passages):06d}", "\n".join(current), True))
    return passages, f"{', '.join(paths)} (one paragraph per line), in passages of ≥ {passage_words} words"


def draw(candidates: list, n: int, per_passage: int, rng: random.Random) -> list:
    """Up to n candidates, uniformly at random with at most per_passage from one passage; returned in input order."""
    order = list(range(len(candidates)))
    rng.shuffle(order)
    taken, count = [], {}
    for i in order:
        p = candidates[i][0]
        if count.get(p, 0) < per_passage:
            count[p] = count.get(p, 0) + 1
            taken.append(i)
            if len(taken) == n:
                break
    return [candidates[i] for i in sorted(taken)]


def build_items(passages, cloze_items, mc_items, seed, per_passage, min_context_words):
    """(cloze items, mc4 items) as JSON-ready dicts."""
    cloze, mc, pool, seen = [], [], [], set()
    for p, (name, text, clean_head) in enumerate(passages):
        for s in split_sentences(text, p, clean_head):
            sentence = text[s.start:s.end]
            enough = len(text[:s.start].split()) >= min_context_words
            m = FINAL_WORD.search(sentence)
            if m and s.complete and len(text[:s.start + m.start()].split()) >= min_context_words:
                cloze.append((p, {"id": f"{name}@{s.start + m.start()}", "context": text[:s.start + m.start() - 1],
                                  "target": m.group(1)}))
            if s.complete and s.clean_start and enough:
                mc.append((p, {"id": f"{name}@{s.start}", "context": text[:s.start].rstrip(),
                               "sep": "\n" if s.first else " ", "true": sentence}))
            if s.complete and s.clean_start and sentence not in seen:
                seen.add(sentence)
                pool.append((p, sentence))
    cloze = [item for _, item in draw(cloze, cloze_items, per_passage, random.Random(seed))]
    rng = random.Random(seed + 1)
    items = []
    for p, item in draw(mc, mc_items, per_passage, rng):
        true = item.pop("true")
        # length-matched: a log-likelihood falls with length, so a longer or shorter true sentence would give
        # acc (unnormalized) away; a random model then scores ~25% on acc and acc_norm alike
        others = sorted((abs(len(s) - len(true)), s) for q, s in pool if q != p and s != true)
        choices = rng.sample([s for _, s in others[:NEIGHBOURS]], 3) + [true]
        rng.shuffle(choices)
        items.append({**item, "choices": choices, "label": choices.index(true)})
    return cloze, items


HEADER = """\
{about}
# {n} items. Built by tools/make_tasks.py, which rebuilds these files exactly with:
#   {command}
# local_data.py (next to this file) reads the JSONL relative to this directory, from any working directory.
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {task}.jsonl
custom_dataset: !function local_data.load
test_split: test
"""
METRIC = "  - metric: {}\n    aggregation: {}\n    higher_is_better: {}\n"
KINDS = {   # what the header says, then the rest of the yaml
    "cloze": ("LAMBADA-style last-word prediction (like lm-eval's lambada_openai). Each item is a passage cut before "
              "the last word of one of its sentences; the target is that word. acc: the model's greedy continuation "
              "is exactly ' <word>' (loglikelihood is_greedy); perplexity: exp(-mean log-likelihood of the word).",
              "output_type: loglikelihood\ndoc_to_text: \"{{context}}\"\ndoc_to_target: \"{{' ' + target}}\"\n"
              "metric_list:\n" + METRIC.format("perplexity", "perplexity", "false")
              + METRIC.format("acc", "mean", "true")),
    "mc4": ("4-way multiple-choice continuation. Each item is a passage cut before one of its sentences; the choices "
            "are that sentence and three complete sentences from other passages, drawn from the 12 closest to it in "
            "length (characters), in a seeded order. `sep` is what precedes the true sentence: ' ' inside a "
            "paragraph, '\\n' when it starts one "
            "(lm-eval moves it from the context to the front of every choice, so all four are scored as the same "
            "kind of continuation). acc: the true sentence has the highest log-likelihood; acc_norm: the highest "
            "log-likelihood per byte.",
            "output_type: multiple_choice\ndoc_to_text: \"{{context}}{{sep}}\"\ntarget_delimiter: \"\"\n"
            "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\nmetric_list:\n"
            + METRIC.format("acc", "mean", "true") + METRIC.format("acc_norm", "mean", "true")),
}


def task_yaml(task: str, kind: str, about: str, n: int, command: str) -> str:
    what, body = KINDS[kind]
    comment = "\n".join(textwrap.wrap(f"{task}: {what}", 116, initial_indent="# ", subsequent_indent="# ") +
                        textwrap.wrap(f"Held-out source: {about}.", 116, initial_indent="# ", subsequent_indent="# "))
    return HEADER.format(about=comment, n=n, command=command, task=task) + body + "metadata:\n  version: 1.0\n"


def command_line(args) -> str:
    source = f"--shards {args.shards} --split {args.split}" if args.shards else \
        f"--input {' '.join(args.input)} --passage-words {args.passage_words}"
    return (f"python tools/make_tasks.py {source} --out {args.out} --prefix {args.prefix} --seed {args.seed} "
            f"--cloze-items {args.cloze_items} --mc-items {args.mc_items} --per-passage {args.per_passage} "
            f"--min-context-words {args.min_context_words}")


def make_tasks(args) -> dict[str, int]:
    """Write the two tasks into args.out; {task name: items}."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", args.prefix):
        raise UsageError(f"--prefix {args.prefix!r} must be letters, digits and _ (it names the tasks)")
    for name in ("cloze_items", "mc_items", "per_passage"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out} is a file, not a directory")
    if args.shards:
        passages, about = read_shard_passages(args.shards, args.split, not args.quiet)
    else:
        passages, about = read_text_passages(args.input, args.passage_words, not args.quiet)
    cloze, mc = build_items(passages, args.cloze_items, args.mc_items, args.seed, args.per_passage,
                            args.min_context_words)
    if not cloze or not mc:
        raise UsageError(f"no {'cloze' if not cloze else 'multiple-choice'} item in the text of "
                         f"{args.shards or ', '.join(args.input)}: give more text or a smaller --min-context-words")
    os.makedirs(args.out, exist_ok=True)
    counts = {}
    for kind, items in (("cloze", cloze), ("mc4", mc)):
        task = f"{args.prefix}_{kind}"
        with open(os.path.join(args.out, f"{task}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
        with open(os.path.join(args.out, f"{task}.yaml"), "w", encoding="utf-8") as f:
            f.write(task_yaml(task, kind, about, len(items), command_line(args)))
        counts[task] = len(items)
    target = os.path.join(args.out, "local_data.py")
    if os.path.abspath(target) != os.path.abspath(LOADER):
        shutil.copyfile(LOADER, target)
    return counts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--shards", metavar="DIR", help="a tools/make_shards.py directory: decode one split of it")
    source.add_argument("--input", nargs="+", metavar="FILE", help="held-out text files, one paragraph per line")
    p.add_argument("--split", default="val", help="with --shards: the split to decode (default val)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the .jsonl, .yaml and local_data.py")
    p.add_argument("--prefix", required=True, help="task names are <prefix>_cloze and <prefix>_mc4 (letters, digits, _)")
    p.add_argument("--seed", type=int, default=0, help="seed of the item draw and the choices (default 0)")
    p.add_argument("--cloze-items", type=int, default=400, help="cloze items at most (default 400)")
    p.add_argument("--mc-items", type=int, default=400, help="multiple-choice items at most (default 400)")
    p.add_argument("--per-passage", type=int, default=3, help="items of one task per passage at most (default 3)")
    p.add_argument("--min-context-words", type=int, default=20, help="words of context at least (default 20)")
    p.add_argument("--passage-words", type=int, default=100, help="with --input: words per passage (default 100)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_remote_arguments(p)
    return p.parse_args(argv)


@one_line_errors
def main(argv=None):
    args = parse_args(argv)
    configure_remote(args)   # --shards at a URL: its CA and headers
    counts = make_tasks(args)
    print(f"wrote {args.out}: " + ", ".join(f"{task} ({n} items)" for task, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
