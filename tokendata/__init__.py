"""The data layer: token shards, from the text they are made of to the batches a rank trains on.

    remote.py       where shards live (a directory, http(s)://, pipe:COMMAND, fsspec URLs) and DataError
    shards.py       the shard format and its manifest, written by tools/make_shards.py; the checks of a shard set
                    against a model (vocabulary, sequence length)
    shard_files.py  fetching, verifying (data.verify) and parsing one shard; what a bad one does
    sources.py      the sources of a stream (one shard set, or several blended by weight) and the rules between them
    order.py        the train order: the blend's picks, canonical streams, exact epochs; a function of the data
                    settings and seed alone, read by any data-parallel size dividing the global batch
    reading.py      what the readers (DataLoader workers) do: each rank's positions, its streams' windows read ahead
    shard_pool.py   the shards a reader holds: at most data.fetch_threads in memory, the rest on the local disk
    stream.py       TokenStream: the resumable, deterministic train batches of one data-parallel rank, and its
                    validation batches
    shard_stream_order.py  the order of canonical streams dealt by shard, for the checkpoints of runs started with it
    rank_order.py   the order of runs started before canonical streams (shards dealt to ranks), for their checkpoints
    corpus.py       reading a corpus: text (a document a line), JSONL, Parquet, Hugging Face datasets (a record a
                    document, newlines kept); bad records
    tokenizer.py    the tokenizer of a shard set: sentencepiece or Hugging Face, one interface for every reader
    encode.py       a corpus into one stream of ids, in N processes, the same for any N

It imports nothing from the rest of the project: the trainer (pretrain/), evaluation (evaluation/) and the data
commands (tools/make_shards.py, tools/make_tasks.py, tools/train_tokenizer.py) all build on it.
"""
