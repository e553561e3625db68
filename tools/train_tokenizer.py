"""Train a sentencepiece tokenizer on text files, streaming.

    python tools/train_tokenizer.py --input data/austen.txt.gz --vocab-size 8000 --out runs/tok/tokenizer.model

Input (tokendata/corpus.py): plain, gzip or zstd text, one document/paragraph per line (blank lines are skipped);
JSONL, Parquet or a Hugging Face dataset, one document a record (--format, --text-key, --split, --bad-records).

Memory stays bounded on any input size: the lines are streamed through a reservoir sampler that keeps a uniform
random sample of at most `--max-sentences` of them, and that sample is fed to sentencepiece through
`sentence_iterator`. The sampler is our own `random.Random(seed)`: sentencepiece's built-in one (`input_sentence_size`
+ `shuffle_input_sentence`) draws from a thread-local generator and gave a different sample on every run even after
`set_random_generator_seed`. So a given input, seed and --threads always give the same model file (the thread count is
recorded in the file).

The model is lossless on any text: byte_fallback turns characters outside the learned alphabet into byte pieces
instead of <unk>, and the identity normalization (no NFKC, whitespace kept) means decode(encode(text)) == text.
Ids: unk=0, bos=1, eos=2, no pad (-1); make_shards.py appends eos after every document.
"""

import argparse
import io
import os
import random
import sys

from cli import UsageError, one_line_errors
from tokendata import corpus as corpora

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
MAX_SENTENCE_BYTES = 1 << 16
# A longer line is cut into pieces of this many characters (4 bytes per char at most in UTF-8): sentencepiece would
# otherwise drop the whole line, and for learning a vocabulary a paragraph split in two loses nothing.
CHUNK_CHARS = MAX_SENTENCE_BYTES // 4


def sample_sentences(corpus, max_sentences, seed, progress=True):
    """A uniform random sample of at most max_sentences pieces of documents (reservoir sampling, Algorithm R),
    seeded."""
    rng = random.Random(seed)
    kept = []
    seen = 0
    for doc in corpus.documents(progress=progress):
        for start in range(0, len(doc), CHUNK_CHARS):
            piece = doc[start : start + CHUNK_CHARS]
            if len(kept) < max_sentences:
                kept.append(piece)
            else:
                j = rng.randrange(seen + 1)
                if j < max_sentences:
                    kept[j] = piece
            seen += 1
    if not kept:
        raise UsageError(f"no text in {', '.join(corpus.paths)}: every document is empty")
    return kept


def train(paths, vocab_size, out, model_type="bpe", seed=0, max_sentences=500_000, threads=None,
          progress=True, verbose=False, corpus=None):
    """Train and write the model to `out` (written to a temporary name first, so a failed run leaves no half file).
    corpus: a tokendata.corpus.Corpus of the inputs (default: `paths` with their formats found)."""
    import sentencepiece as spm

    corpus = corpus or corpora.Corpus(paths)
    if vocab_size < 300:
        # 3 special ids + 256 byte pieces + the alphabet: below this sentencepiece fails with a long message.
        raise UsageError(f"--vocab-size {vocab_size} is too small: byte_fallback alone needs 259 ids; use >= 300")
    if max_sentences < 1:
        raise UsageError(f"--max-sentences must be >= 1, got {max_sentences}")
    sample = sample_sentences(corpus, max_sentences, seed, progress)
    if corpus.skip_note():
        print(corpus.skip_note(), file=sys.stderr)
    spm.set_random_generator_seed(seed)  # sentencepiece draws no other random numbers for bpe/unigram; set it anyway
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sample),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            character_coverage=0.9995,
            max_sentence_length=MAX_SENTENCE_BYTES,
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
            num_threads=threads or os.cpu_count() or 1,
            minloglevel=0 if verbose else 2,
        )
    except RuntimeError as e:
        # sentencepiece reports bad settings/inputs as RuntimeError with a multi-line text: keep its first line.
        raise UsageError(f"sentencepiece: {str(e).strip().splitlines()[0]}") from None
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp, out)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Input lines are documents; the model is written to --out.")
    corpora.add_arguments(p)
    p.add_argument("--vocab-size", type=int, required=True,
                   help="number of ids, including 3 specials and 256 byte pieces")
    p.add_argument("--out", required=True, metavar="PATH", help="model file to write, e.g. runs/tok/tokenizer.model")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe",
                   help="sentencepiece algorithm (default bpe)")
    p.add_argument("--seed", type=int, default=0, help="seed of the line sampler (default 0)")
    p.add_argument("--max-sentences", type=int, default=500_000,
                   help="train on a uniform sample of at most this many lines, bounding memory (default 500000)")
    p.add_argument("--threads", type=int, default=None, help="training threads (default: all cores)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="show sentencepiece's own log")
    return p.parse_args(argv)


@one_line_errors
def main(argv=None):
    args = parse_args(argv)
    out = train(args.input, args.vocab_size, args.out, args.model_type, args.seed, args.max_sentences,
                args.threads, progress=not args.quiet, verbose=args.verbose, corpus=corpora.Corpus.from_args(args))
    print(f"wrote {out} (vocab_size={args.vocab_size}, {args.model_type}, seed={args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
