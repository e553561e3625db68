"""The tokenizer of a shard set: a sentencepiece model, or any Hugging Face tokenizer, behind one interface that
every reader uses (tools/make_shards.py, the trainer, evaluation, tools/generate.py, the lm-eval adapter).

    load(path)          a tokenizer from its file: `tokenizer.model` (sentencepiece) or `tokenizer.json` (Hugging Face
                        `tokenizers`, with its eos named by a `tokenizer_config.json` beside it)
    prepare(source, eos=None)   what tools/make_shards.py accepts: a sentencepiece model, a tokenizer.json, or a local
                        directory that transformers.AutoTokenizer loads (a fast tokenizer: its `tokenizers` backend is
                        what gets used and saved); eos from the tokenizer, or the token `eos` names
    contents(tok)       {file name: bytes} of its files in a shard directory (sentencepiece: tokenizer.model; Hugging
                        Face: tokenizer.json and a tokenizer_config.json naming its eos_token); the manifest records
                        the first's name, the kind and the first's sha256 ("tokenizer", "tokenizer_kind",
                        "tokenizer_sha256")
    files(path)         the files that make up the tokenizer at `path` (what a checkpoint or a release copies)
    local_copy(url, directory)  a local path of a tokenizer that may be remote (with its config)

Both kinds answer as sentencepiece's processor does: encode(text or [texts]) -> ids (no bos, no eos: make_shards
appends eos after each document), decode(ids) -> text (special tokens give no text), eos_id(), vocab_size() (one past
the largest id), id_to_piece(id), and word_start(id): whether the token's text begins with a space ("▁", "Ġ"),
which a decode of that token alone drops for a sentencepiece model. A Hugging Face tokenizer encodes with
add_special_tokens=False: a post-processor that adds bos (Llama's) is not applied, as the training stream has none.
"""
from __future__ import annotations

import hashlib
import json
import os

import sentencepiece as spm

from tokendata import remote
from tokendata.remote import DataError

SENTENCEPIECE, HUGGINGFACE = "sentencepiece", "huggingface"
SP_FILE, HF_FILE, HF_CONFIG = "tokenizer.model", "tokenizer.json", "tokenizer_config.json"
# a tokenizer.json without a tokenizer_config.json beside it: the first of these that it holds as a special token
KNOWN_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
SPACES = ("▁", "Ġ", " ")


class SentencePiece(spm.SentencePieceProcessor):
    """A sentencepiece model (tools/train_tokenizer.py's): sentencepiece's own processor, plus `word_start`."""
    kind, file = SENTENCEPIECE, SP_FILE

    def __init__(self, path: str):
        try:
            super().__init__(model_file=path)
        except (RuntimeError, OSError) as e:
            raise DataError(f"cannot load tokenizer {path}: {str(e).strip().splitlines()[0]}") from None
        self.path = path

    def word_start(self, i: int) -> bool:
        return self.id_to_piece(int(i)).startswith("▁")


class HuggingFace:
    """A Hugging Face `tokenizers` tokenizer and the token that ends a document."""
    kind, file = HUGGINGFACE, HF_FILE

    def __init__(self, tok, path: str, eos: str | None):
        self.tok, self.path = tok, path
        special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        self.eos_token = eos or next((t for t in KNOWN_EOS if t in special), None)
        if self.eos_token is None:
            raise DataError(f"tokenizer {path} has no eos token (no {HF_CONFIG} names one, and it holds none of "
                            f"{', '.join(KNOWN_EOS)}): name the token that ends a document with --eos TOKEN")
        self._eos = tok.token_to_id(self.eos_token)
        if self._eos is None:
            raise DataError(f"tokenizer {path} has no token {self.eos_token!r} for eos: pass --eos with one it has")
        self._vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1

    @classmethod
    def from_file(cls, path: str, eos: str | None = None):
        """A tokenizer.json; eos: `eos`, else the eos_token of the tokenizer_config.json beside it, else the first of
        KNOWN_EOS that it holds as a special token."""
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(path)
        except Exception as e:   # the Rust side raises plain Exceptions with a one-line message
            raise DataError(f"cannot load tokenizer {path}: {str(e).strip().splitlines()[0]}") from None
        return cls(tok, path, eos or config_eos(os.path.join(os.path.dirname(path), HF_CONFIG)))

    def encode(self, text, num_threads: int | None = None):
        """ids of a text, or a list of ids of each of a list of texts (num_threads > 1: by tokenizers' own thread
        pool, whose size RAYON_NUM_THREADS sets before its first use)."""
        if not isinstance(text, list):
            return self.tok.encode(text, add_special_tokens=False).ids
        if (num_threads or 1) > 1:
            return [e.ids for e in self.tok.encode_batch_fast(text, add_special_tokens=False)]
        return [self.tok.encode(t, add_special_tokens=False).ids for t in text]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def eos_id(self) -> int:
        return self._eos

    def vocab_size(self) -> int:
        return self._vocab

    def id_to_piece(self, i: int) -> str:
        return self.tok.id_to_token(int(i)) or ""

    def word_start(self, i: int) -> bool:
        return self.id_to_piece(i).startswith(SPACES)


def config_eos(path: str) -> str | None:
    """The eos_token of a tokenizer_config.json (a string, or {"content": ...} as older files write it), if any."""
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def load(path: str, eos: str | None = None):
    """The tokenizer in `path` (a tokenizer.model or a tokenizer.json); DataError, one line, for anything else."""
    if not os.path.isfile(path):
        raise DataError(f"tokenizer file not found: {path}")
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    if path.endswith(".json") or head.startswith(b"{"):
        return HuggingFace.from_file(path, eos)
    return SentencePiece(path)


def prepare(source: str, eos: str | None = None):
    """The tokenizer tools/make_shards.py was given: a file (load), or a directory that transformers.AutoTokenizer
    loads, offline; its `tokenizers` backend is used from then on (saved as tokenizer.json)."""
    if not os.path.isdir(source):
        if not os.path.exists(source):
            raise DataError(f"tokenizer not found: {source} (a sentencepiece tokenizer.model from "
                            "tools/train_tokenizer.py, a Hugging Face tokenizer.json, or a tokenizer directory)")
        tok = load(source, eos)
        if eos and tok.kind == SENTENCEPIECE and tok.id_to_piece(tok.eos_id()) != eos:
            raise DataError(f"--eos {eos}: a sentencepiece model's eos is its own ({tok.id_to_piece(tok.eos_id())})")
        return tok
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"{source} is a directory: loading it needs transformers (pip install transformers)") from None
    try:
        auto = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception as e:   # transformers raises OSError, ValueError, KeyError... with long messages
        raise DataError(f"cannot load tokenizer directory {source} with AutoTokenizer: "
                        f"{str(e).strip().splitlines()[0]}") from None
    backend = getattr(auto, "backend_tokenizer", None)
    if backend is None:
        raise DataError(f"{source}: AutoTokenizer gave {type(auto).__name__}, which has no `tokenizers` backend (a "
                        "fast tokenizer): give its tokenizer.json, or a sentencepiece tokenizer.model")
    return HuggingFace(backend, source, eos or auto.eos_token)


def contents(tok) -> dict[str, bytes]:
    """{file name: bytes} of the tokenizer's files in a shard directory; the first is its main file."""
    if tok.kind == SENTENCEPIECE:
        with open(tok.path, "rb") as f:
            return {SP_FILE: f.read()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token}
    return {HF_FILE: tok.tok.to_str().encode("utf-8"), HF_CONFIG: json.dumps(config, indent=1).encode("utf-8")}


def local_copy(url: str, directory: str) -> str:
    """A local path of the tokenizer at `url` (itself when local): a remote one is fetched into `directory` with the
    files that belong to it (a tokenizer.json's config), under a folder unique to the URL."""
    if not remote.is_remote(url):
        return url
    folder = os.path.join(directory, "tokenizer-" + hashlib.sha1(url.encode()).hexdigest()[:12])
    hf = HF_FILE in url
    wanted = {HF_FILE: url, HF_CONFIG: HF_CONFIG.join(url.rsplit(HF_FILE, 1))} if hf else {SP_FILE: url}
    for name, source in wanted.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            os.makedirs(folder, exist_ok=True)
            data = remote.fetch(source, what="tokenizer file")[0]
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
    name = HF_FILE if hf else SP_FILE
    return os.path.join(folder, name)


def files(path: str) -> list[str]:
    """The files of the tokenizer at `path`: itself, and for a tokenizer.json the tokenizer_config.json beside it."""
    config = os.path.join(os.path.dirname(path), HF_CONFIG)
    return [path] + ([config] if os.path.basename(path) == HF_FILE and os.path.isfile(config) else [])


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
