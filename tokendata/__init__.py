"""The data layer: token shards, from the text they are made of to the batches a rank trains on.

    remote.py       where shards live (a directory, http(s)://, pipe:COMMAND, fsspec URLs) and DataError
    shards.py       the shard format and its manifest, written by tools/make_shards.py; the checks of a shard set
                    against a model (vocabulary, sequence length)
    shard_files.py  fetching and parsing one shard; what a bad one does
    stream.py       TokenStream: the resumable, deterministic train batches of one data-parallel rank, and its
                    validation batches
    corpus.py       reading a text corpus (plain or gzip, one document a line)

It imports nothing from the rest of the project: the trainer (pretrain/), evaluation (evaluation/) and the data
commands (tools/make_shards.py, tools/make_tasks.py, tools/train_tokenizer.py) all build on it.
"""
