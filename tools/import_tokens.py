"""Import a corpus tokenized elsewhere into shards (tokendata/shards.py, the same files tools/make_shards.py writes
from the same ids), without detokenizing: Megatron-LM's / GPT-NeoX's .bin + .idx, MosaicML's MDS, or .npy token
arrays (OLMo's headerless ones with --dtype).

    python tools/import_tokens.py --format megatron --input corpus_text_document --tokenizer tok/tokenizer.json \\
        --out shards --seq-len 2048
    python tools/import_tokens.py --format mds --input mds_folder --tokenizer tok/ --out shards --seq-len 2048
    python tools/import_tokens.py --format npy --dtype uint32 --input part-0-00000.npy part-0-00001.npy \\
        --tokenizer allenai/dolma2-tokenizer --out shards --seq-len 4096

Documents: a Megatron document (one or more sequences of its index) or an MDS sample is one document, and an eos is
put after it unless it ends with one (the tokenizer's eos, as make_shards puts it); token arrays hold documents
already separated by eos, and a file's end ends one. The inputs are read in the order given, as one stream, then cut
and split as make_shards does (--seq-len, --samples-per-shard, --val-fraction, --seed). Every id is checked against
the tokenizer given: an id it does not have stops the import, naming the file.
"""
import argparse
import sys
import time

import numpy as np

from cli import UsageError, one_line_errors
from tokendata import tokenizer as tokenizers
from tokendata.imports import checked, in_vocab, megatron, mds, npy
from tokendata.packing import Packer
from tokendata.shards import dtype_for
from tools.make_shards import prepare_out_dir, wrote_line

READERS = {"megatron": lambda path, args, eos: megatron.chunks(path, eos),
           "mds": lambda path, args, eos: mds.chunks(path, args.mds_column, args.dtype, eos),
           "npy": lambda path, args, eos: npy.chunks(path, args.dtype, eos)}


def import_tokens(args, progress=True) -> dict:
    """Write the shards and manifest.json; return the manifest with a "stats" entry (ids read, bytes, seconds)."""
    if args.seq_len < 1 or args.samples_per_shard < 1:
        raise UsageError(f"--seq-len and --samples-per-shard must be >= 1, got {args.seq_len} and "
                         f"{args.samples_per_shard}")
    if not 0.0 <= args.val_fraction < 1.0:
        raise UsageError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    tok = tokenizers.prepare(args.tokenizer, args.eos)
    vocab, eos = tok.vocab_size(), tok.eos_id()
    if eos < 0:
        raise UsageError(f"tokenizer {args.tokenizer} has no eos id: name one with --eos")
    prepare_out_dir(args.out, args.force)
    packer = Packer(args.out, args.seq_len, args.samples_per_shard, args.val_fraction, args.seed, dtype_for(vocab))
    t0, read, nbytes = time.perf_counter(), 0, 0
    for path in args.input:
        for docs, where in READERS[args.format](path, args, eos):
            size = int(docs.lengths.sum())
            read, nbytes = read + size, nbytes + size * docs.dtype.itemsize
            if docs.dtype.itemsize == np.dtype(packer.numpy_dtype).itemsize:   # copied from where they lie
                in_vocab(*packer.add_documents(docs), vocab, where)
            else:   # ids of another width: joined, checked, then converted (one copy more)
                packer.add(checked(docs.ids(0, docs.tokens), vocab, where))
            if progress:
                print(f"\rimporting {where}: {read:,} ids, {nbytes / 1e6:,.0f} MB, "
                      f"{nbytes / 1e6 / max(time.perf_counter() - t0, 1e-9):,.0f} MB/s", end="", file=sys.stderr,
                      flush=True)
    packer.close()
    if progress:
        print(file=sys.stderr)
    if packer.writers["train"].samples == 0:
        raise UsageError(f"{', '.join(args.input)}: only {packer.tokens} ids, not one train sample of "
                         f"{args.seq_len + 1}: give more or a smaller --seq-len")
    manifest = packer.finish(tok, args.tokenizer, args.input, {"formats": [args.format], "dtype": args.dtype})
    manifest["stats"] = {"ids": read, "bytes": nbytes, "stream_tokens": packer.tokens,
                         "seconds": time.perf_counter() - t0, "dropped_tokens": packer.dropped}
    return manifest


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", required=True, choices=sorted(READERS), help="how the inputs are stored")
    p.add_argument("--input", required=True, nargs="+", metavar="PATH",
                   help="megatron: a dataset's prefix (or its .bin or .idx); mds: a folder with index.json; npy: "
                        "token array files; several are read in order, as one stream")
    p.add_argument("--dtype", choices=["uint8", "uint16", "int16", "uint32", "int32", "int64", "uint64"],
                   help="the ids' type where the files do not say: headerless token arrays (OLMo: uint16 for "
                        "vocabularies up to 65536, else uint32), an MDS column of raw bytes")
    p.add_argument("--mds-column", metavar="NAME", help="the MDS column of token ids (default: tokens, input_ids)")
    p.add_argument("--tokenizer", required=True, metavar="PATH",
                   help="the tokenizer the corpus was made with (as tools/make_shards.py takes it): its ids are "
                        "checked, its eos ends documents, and it is copied beside the shards")
    p.add_argument("--eos", metavar="TOKEN", help="the token that ends a document, for a tokenizer that names none")
    p.add_argument("--out", required=True, metavar="DIR", help="the shard directory to write")
    p.add_argument("--seq-len", type=int, required=True, help="n: each sample holds n+1 tokens")
    p.add_argument("--samples-per-shard", type=int, default=1000, help="samples in each .tar (default 1000)")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="probability that a sample goes to val (default 0.01)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val assignment (default 0)")
    p.add_argument("--force", action="store_true", help="replace shards already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p.parse_args(argv)


@one_line_errors
def main(argv=None):
    args = parse_args(argv)
    m = import_tokens(args, progress=not args.quiet)
    st, secs = m["stats"], max(m["stats"]["seconds"], 1e-9)
    print(wrote_line(args.out, m))
    print(f"read {st['ids']:,} ids ({st['bytes'] / 1e6:.1f} MB) into a stream of {st['stream_tokens']:,} tokens "
          f"({st['dropped_tokens']} left over at the end) in {secs:.1f} s: {st['bytes'] / 1e6 / secs:.0f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
