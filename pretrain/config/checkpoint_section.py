"""The `checkpoint:` section: where checkpoints go (a directory or a bucket), how often, what is kept, whether saves
run in the background (pretrain/checkpoints/). Its own file beside sections.py, as fleet_section.py and schedule.py."""
from __future__ import annotations

from dataclasses import dataclass

from model.fields import check_types, described, need


@dataclass(kw_only=True)
class CheckpointSection:
    """DeepSpeed checkpoints (model, optimizer, scheduler, data position, this config)."""
    every: int = described("save every this many optimizer steps (and at the end of the run)", 1000)
    keep: int = described("keep the last this many checkpoints, delete older ones", 3)
    keep_every: int | None = described("also keep for good every checkpoint whose step is a multiple of this (e.g. "
                                       "10000); null = none beyond the last `keep`", None)
    dir: str | None = described("checkpoint directory, or an object store URL (s3://bucket/prefix, gs://…: each "
                                "rank writes to checkpoint.staging_dir, uploads, then rank 0 commits in the bucket; "
                                "credentials from the backend's own settings, e.g. AWS_*); default "
                                "<train.run_dir>/checkpoints", None)
    staging_dir: str | None = described("with checkpoint.dir in a bucket: the local directory where each rank writes "
                                        "a checkpoint before uploading it, and where a resume downloads one; default "
                                        "<train.run_dir>/checkpoint_staging", None)
    resume: str = described("'auto' (latest in dir, if any), 'none' (start fresh), or a checkpoint path", "auto")
    async_save: bool = described("save in the background: a step waits only for a copy of the state in host memory "
                                 "(pinned on a GPU), a writer thread writes the files, and the checkpoint is "
                                 "published (complete.json, `latest`) at a later step, once every rank's writer is "
                                 "done (with checkpoint.dir in a bucket: written and uploaded); costs host memory of one copy of this rank's model and optimizer state",
                                 False)
    relayout: bool = described("when the checkpoint to resume is of another layout (TP, PP, ZeRO-3, world size): "
                               "launch/pretrain.sh converts it to a universal checkpoint first, and the run resumes "
                               "from it with its optimizer state (one launcher; with NNODES launchers, convert "
                               "first: tools/convert.py to-universal)", False)
    extend_length: bool = described("when the checkpoint to resume was trained at a smaller model.max_seq_len than "
                                    "this config's: load it grown to this length, every position-indexed weight "
                                    "interpolated (model/extend.py, as tools/convert.py extend-length does), with a "
                                    "fresh optimizer state for every weight (the Adam moments start from zero); the "
                                    "step, the LR schedule and the data position (by step) carry on. False: a "
                                    "resume at another max_seq_len is an error", False)

    def __post_init__(self):
        check_types(self, "checkpoint")
        need(self.every >= 1, "checkpoint.every", self.every, "≥ 1")
        need(self.keep >= 1, "checkpoint.keep", self.keep, "≥ 1")
        need(self.keep_every is None or self.keep_every >= 1, "checkpoint.keep_every", self.keep_every, "≥ 1 or null")
        need(bool(self.resume), "checkpoint.resume", self.resume, "auto, none, or a path")
        for key in ("dir", "resume"):
            value = getattr(self, key)
            need(not value or not value.startswith(("http://", "https://", "pipe:")), f"checkpoint.{key}", value,
                 "a local path or an object store URL (s3://bucket/prefix, gs://…)")
