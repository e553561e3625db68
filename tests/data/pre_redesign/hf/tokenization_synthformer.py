"""SynthformerTokenizer: the run's sentencepiece model behind the Hugging Face tokenizer interface.

It encodes text exactly as the training data was encoded (tools/make_shards.py: `sp.encode(document)`, no BOS,
eos appended after each document by the data pipeline, not by the tokenizer), so `tokenizer(text).input_ids` is
what the model saw in training, and `decode` is sentencepiece's own (byte-fallback pieces become text again).
The special tokens are read from the model file: eos/bos/unk/pad are the pieces at sentencepiece's eos_id, bos_id,
unk_id, pad_id (an id of -1 means the model has none). Shipped inside a Hugging Face export by model/hf.py.
"""
from __future__ import annotations

import sentencepiece as spm
from transformers.tokenization_utils_sentencepiece import SentencePieceBackend


class SynthformerTokenizer(SentencePieceBackend):
    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]
    padding_side = "right"   # the model mixes by absolute position: left padding would shift every token

    def __init__(self, vocab_file: str, **kwargs):
        sp = spm.SentencePieceProcessor(model_file=vocab_file)
        for name, sp_id in (("eos_token", sp.eos_id()), ("bos_token", sp.bos_id()), ("unk_token", sp.unk_id()),
                            ("pad_token", sp.pad_id())):
            if sp_id >= 0:
                kwargs.setdefault(name, sp.id_to_piece(sp_id))
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(vocab_file=vocab_file, legacy=True, **kwargs)   # legacy: plain sp.encode, no prefix tricks

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.sp_model.decode_pieces(tokens)
