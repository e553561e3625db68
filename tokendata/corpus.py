"""Reading a corpus: the documents that the tokenizer trainer, the shard writer, the task builder and evaluation on
text files share, from the forms corpora come in.

    text      plain, .gz or .zst text, one document a line: each non-empty line, stripped
    jsonl     one JSON object a line (.jsonl, .json, .ndjson; plain, .gz or .zst): the string under --text-key
    parquet   the string column --text-key, row by row (pyarrow)
    hf        a Hugging Face dataset saved with save_to_disk (a Dataset, or a DatasetDict and --split), or local data
              files read by `datasets` (a folder of them, or files), streamed, --split; nothing is fetched from a hub
              (the optional extra: pip install 'synthformer[data]', or pip install datasets)

A record of jsonl, parquet or hf is one document, kept as it is: its newlines stay and are tokenized; a record
whose text is empty or only whitespace is passed over. The format is found from each input (a directory: hf;
.parquet or the Parquet magic bytes: parquet; .jsonl/.json/.ndjson before any .gz/.zst: jsonl; else text), or given
(--format). Compression is found from the first bytes (gzip, zstd).

Bad records: invalid JSON, a record without the key, a value that is not a string (a null in Parquet) is a DataError
of one line naming the file and the line (jsonl, counted from 1) or row (parquet and hf, counted from 0, as their
indexes are); under bad_records="skip" the record is left out and counted (Corpus.skipped, Corpus.first_bad).
"""
from __future__ import annotations

import gzip
import io
import json
import os
import sys

from tqdm import tqdm

from tokendata.remote import DataError

FORMATS = ("text", "jsonl", "parquet", "hf")
BAD_RECORDS = ("fail", "skip")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".parquet": "parquet", ".csv": "csv",
                      ".txt": "text", ".arrow": "arrow"}
ZSTD_MAGIC, GZIP_MAGIC, PARQUET_MAGIC = b"\x28\xb5\x2f\xfd", b"\x1f\x8b", b"PAR1"
BATCH_ROWS = 4096


def add_arguments(p, inputs_help: str = "the corpus") -> None:
    """The input options every corpus-reading command shares."""
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help=f"{inputs_help}: text (plain/.gz/.zst, a document a line), JSONL (.jsonl[.gz|.zst]), Parquet, "
                        "or a Hugging Face dataset directory (saved with save_to_disk, or of data files)")
    add_record_arguments(p)


def add_record_arguments(p, split_flag: str = "--split") -> None:
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="the inputs' format (default: found from each input's name and first bytes)")
    p.add_argument("--text-key", default="text", metavar="KEY",
                   help="JSONL key / Parquet or dataset column holding a document's text (default text)")
    p.add_argument(split_flag, dest="dataset_split", default="train", metavar="SPLIT",
                   help="split of a Hugging Face dataset (default train)")
    p.add_argument("--bad-records", choices=BAD_RECORDS, default="fail",
                   help="a record without the key, not a string, or invalid JSON: fail (one line naming the file "
                        "and line) or skip (left out, counted); default fail")


def strip_compression(name: str) -> str:
    return name[:-3] if name.endswith(".gz") else name[:-4] if name.endswith(".zst") else name


def detect(path: str) -> str:
    if os.path.isdir(path):
        return "hf"
    name = strip_compression(path.lower())
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    with open(path, "rb") as f:
        return "parquet" if f.read(4) == PARQUET_MAGIC else "text"


def open_binary(raw):
    """A binary stream over a file object, decompressing gzip and zstd (found from its first bytes)."""
    head = raw.peek(4)[:4]
    if head[:2] == GZIP_MAGIC:
        return gzip.open(raw, "rb")
    if head == ZSTD_MAGIC:
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return raw


def open_text(raw):
    """A text stream over a binary file object, decompressing gzip and zstd."""
    return io.TextIOWrapper(open_binary(raw), encoding="utf-8", errors="replace")


class Corpus:
    """The documents of a list of inputs, in order (`documents()`); what was skipped, counted."""

    def __init__(self, paths, fmt: str | None = None, text_key: str = "text", split: str = "train",
                 bad_records: str = "fail"):
        if fmt is not None and fmt not in FORMATS:
            raise DataError(f"--format {fmt} is not one of {', '.join(FORMATS)}")
        if bad_records not in BAD_RECORDS:
            raise DataError(f"--bad-records {bad_records} is not one of {', '.join(BAD_RECORDS)}")
        self.paths, self.text_key, self.split, self.bad_records = list(paths), text_key, split, bad_records
        for path in self.paths:
            if not os.path.exists(path):
                raise DataError(f"input file not found: {path}")
            if os.path.isdir(path) and fmt not in (None, "hf"):
                raise DataError(f"input {path} is a directory: only --format hf reads one (a Hugging Face dataset)")
        self.formats = [fmt or detect(p) for p in self.paths]
        if "hf" in self.formats:
            datasets_module()   # the missing extra is named before anything is read
        self.skipped, self.first_bad = 0, None

    @classmethod
    def from_args(cls, args, paths=None):
        return cls(paths or args.input, args.format, args.text_key, args.dataset_split, args.bad_records)

    def describe(self) -> dict:
        """What the manifest records of the inputs."""
        return {"paths": [os.path.abspath(p) for p in self.paths], "formats": self.formats, "text_key": self.text_key,
                "bad_records_skipped": self.skipped}

    def skip_note(self) -> str | None:
        if self.skipped:
            return f"skipped {self.skipped} bad records (--bad-records skip); the first: {self.first_bad}"
        return None

    def bad(self, where: str, why: str) -> None:
        """A bad record: a DataError (fail), or counted (skip)."""
        if self.bad_records == "fail":
            raise DataError(f"{where}: {why}: fix the input, pass --text-key KEY for another field, or --bad-records "
                            "skip to leave such records out")
        self.skipped += 1
        self.first_bad = self.first_bad or f"{where}: {why}"

    def documents(self, desc: str = "reading", progress: bool = True):
        """Every document of every input in turn, with a tqdm bar over the bytes read from disk."""
        total = sum(size_on_disk(p) for p in self.paths)
        with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress, file=sys.stderr) as bar:
            for path, fmt in zip(self.paths, self.formats):
                yield from READERS[fmt](self, path, bar)

    def per_input(self) -> list[list[str]]:
        """The documents of each input: evaluation scores each file as its own stream."""
        return [list(Corpus(self.paths[i:i + 1], self.formats[i], self.text_key, self.split,
                            self.bad_records).documents(progress=False)) for i in range(len(self.paths))]


def size_on_disk(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    return os.path.getsize(path)


def read_text(corpus: Corpus, path: str, bar):
    with open(path, "rb") as raw:
        done = 0
        for line in open_text(raw):
            pos = raw.tell()  # position in the file on disk: compressed bytes for .gz, so the total is right
            if pos != done:
                bar.update(pos - done)
                done = pos
            line = line.strip()
            if line:
                yield line


def read_jsonl(corpus: Corpus, path: str, bar):
    key = corpus.text_key
    with open(path, "rb") as raw:
        done = 0
        for number, line in enumerate(open_binary(raw), 1):
            pos = raw.tell()
            bar.update(pos - done)
            done = pos
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:   # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
                corpus.bad(f"{path} line {number}", f"invalid JSON ({str(e).split(':')[0]})")
                continue
            text = checked(corpus, f"{path} line {number}", record, key)
            if text:
                yield text


def checked(corpus: Corpus, where: str, record, key: str) -> str | None:
    """The record's text, or None for a bad (counted) or empty one."""
    if not isinstance(record, dict):
        corpus.bad(where, f"a JSON {type(record).__name__}, not an object with a {key!r} field")
        return None
    if key not in record:
        corpus.bad(where, f"no key {key!r} (it has {', '.join(map(repr, list(record)[:8])) or 'none'})")
        return None
    text = record[key]
    if not isinstance(text, str):
        corpus.bad(where, f"{key!r} is {'null' if text is None else type(text).__name__}, not a string")
        return None
    return text if text.strip() else None


def read_parquet(corpus: Corpus, path: str, bar):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable Parquet file: {str(e).splitlines()[0]}") from None
    schema = f.schema_arrow
    column_check(path, corpus.text_key, schema.names,
                 schema.field(corpus.text_key).type if corpus.text_key in schema.names else None)
    rows, size, done = max(1, f.metadata.num_rows), os.path.getsize(path), 0
    row = 0
    for batch in f.iter_batches(batch_size=BATCH_ROWS, columns=[corpus.text_key]):
        yield from texts_of(corpus, path, row, batch.column(0).to_pylist())
        row += batch.num_rows
        bar.update(size * row // rows - done)
        done = size * row // rows


def column_check(path: str, key: str, names, kind) -> None:
    """A column that is missing or not text fails whatever --bad-records says: every record would be bad."""
    if kind is None:
        raise DataError(f"{path} has no column {key!r} (columns: {', '.join(names)}): pass --text-key COLUMN")
    if "string" not in str(kind):   # pyarrow's string / large_string, datasets' Value('string')
        raise DataError(f"{path}: column {key!r} holds {kind}, not strings: pass --text-key with a text column")


def texts_of(corpus: Corpus, path: str, first_row: int, values):
    for i, text in enumerate(values):
        if not isinstance(text, str):
            corpus.bad(f"{path} row {first_row + i}",
                       f"{corpus.text_key!r} is {'null' if text is None else type(text).__name__}, not a string")
        elif text.strip():
            yield text


def datasets_module():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")   # nothing from a hub while the tools run
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DataError("reading a Hugging Face dataset needs the `datasets` package: pip install 'synthformer[data]' "
                        "(or pip install datasets)") from None
    return datasets


def open_dataset(path: str, split: str):
    """A saved Dataset / DatasetDict (load_from_disk), or local data files streamed by load_dataset."""
    datasets = datasets_module()
    saved = os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                        for f in ("dataset_dict.json", "state.json", "dataset_info.json"))
    try:
        if saved:
            ds = datasets.load_from_disk(path)
        elif os.path.isdir(path):
            ds = datasets.load_dataset(path, split=split, streaming=True)
        else:
            builder = DATA_FILE_BUILDERS.get(os.path.splitext(strip_compression(path.lower()))[1])
            if builder is None:
                raise DataError(f"{path}: datasets reads data files of {', '.join(DATA_FILE_BUILDERS)} (plain, .gz "
                                f"or .zst)")
            ds = datasets.load_dataset(builder, data_files=path, split=split, streaming=True)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise DataError(f"cannot read {path} as a Hugging Face dataset (split {split!r}): "
                        f"{str(e).strip().splitlines()[0]}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path} has splits {', '.join(ds)}, not {split!r}: pass --split")
        ds = ds[split]
    return ds


def read_hf(corpus: Corpus, path: str, bar):
    ds, key = open_dataset(path, corpus.split), corpus.text_key
    if ds.features is not None:   # a streamed dataset may know its columns only once read
        column_check(path, key, list(ds.features), ds.features.get(key))
        ds = ds.select_columns([key])
    size, rows = size_on_disk(path), getattr(ds, "num_rows", None)
    row = done = 0
    for batch in ds.iter(batch_size=BATCH_ROWS):
        if key not in batch:
            column_check(path, key, list(batch), None)
        yield from texts_of(corpus, path, row, batch[key])
        row += len(batch[key])
        if rows:
            bar.update(size * row // rows - done)
            done = size * row // rows
    bar.update(size - done)


READERS = {"text": read_text, "jsonl": read_jsonl, "parquet": read_parquet, "hf": read_hf}


def check_inputs(paths):
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"input file not found: {path}")


def iter_documents(paths, desc="reading", progress=True):
    """The documents of text files (one a line): the plain-text reading of Corpus."""
    return Corpus(paths, "text").documents(desc, progress)


def documents(text: str) -> list[str]:
    """The documents of a text: its non-empty lines, stripped."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def read_texts(paths: list[str]) -> list[str]:
    """Each file's whole text, plain, gzip or zstd."""
    texts = []
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"text file not found: {path}")
        with open(path, "rb") as raw:
            texts.append(open_text(raw).read())
    return texts
