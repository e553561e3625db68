"""The checkpoint formats of a run, read and written in one place. Arrows point one way, down this list:

    safe_load.py      loads that run no code: torch.load(weights_only=True) with the run's types allowed, and a check
                      of the files DeepSpeed's own code loads with weights_only=False
    durable.py        durable writes: atomic small files, complete.json (fsync, sizes, verify), publishing a tag
    resume.py         which checkpoint a run resumes, and one-line reasons why it cannot (another model or layout)
    ds_checkpoint.py  a DeepSpeed checkpoint of any (TP, PP, DP, ZeRO) read back as full tensors; `load_any`: a model
                      from a release or a checkpoint (what evaluation and the tools start from)
    retention.py      which checkpoints a save deletes: all but the last `keep`, except every `keep_every`-th step
    universal.py      universal checkpoints: another layout, AdamW's moments kept (DeepSpeed's converter)
    bucket.py         checkpoints in object storage (checkpoint.dir: s3://…): staged locally, uploaded by every rank,
                      committed by rank 0 (complete.json, then `latest`) once all uploads succeeded; downloads, retention
    async_save.py     saves in the background: host copies of the state dicts, a writer thread per save (which also
                      uploads, in a bucket)
    checkpointer.py   Checkpointer: the trainer's atomic save and exact restore of a DeepSpeed engine and its state

A release (model/release.py) and a Hugging Face export (model/hf.py) are the model's own formats and live with it.
Outside this package, the reading side is `load_any`; the trainer and tools/convert.py use the modules themselves.
"""
from pretrain.checkpoints.ds_checkpoint import load_any

__all__ = ["load_any"]
