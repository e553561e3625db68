"""The sections of a training config: one dataclass per YAML section, every field described (`described`), every
check on a section's own fields in its `__post_init__`, each error naming the dotted key. The model section is
model/config.py's ModelConfig; the whole config is pretrain/config/train_config.py's TrainConfig."""
from __future__ import annotations

from dataclasses import dataclass

from model.config import ConfigError
from model.fields import check_types, described, need
from pretrain.config.batch_ramp import check_ramp
from pretrain.config.schedule import check_decay
from pretrain.timeouts import MARGIN_S, MIN_MARGIN_S, WITHOUT_WATCHDOG_S
from tokendata.shards import DataError
from tokendata.sources import Source, as_sources, as_stages, check_joined


@dataclass(kw_only=True)
class DataSection:
    """Where the token shards are and how they are read."""
    shard_dir: str | None = described("where the shards written by tools/make_shards.py are (beside their "
                        "manifest.json): a directory, or a URL: http(s)://host/path, pipe:COMMAND with {} for the file "
                        "name (pipe:aws s3 cp s3://bucket/shards/{} -), or an fsspec URL (s3://, gs://…, with its "
                        "backend installed); the one source of a run (or data.sources)", None)
    sources: list | None = described("several shard sets blended by weight, instead of shard_dir: a list of {name, "
                        "path, weight}; path: as shard_dir; weight: a proportion ≥ 0 (0.5, 0.3, 0.2, or 5, 3, 2; 0: read only in "
                        "the data.stages that weigh it); "
                        "name: letters, digits, _ - . (it names val/<name>/loss and prefixes sample ids). All share "
                        "one tokenizer, vocabulary, seq_len and eos", None)
    stages: list | None = described("[{step, weights: {source: weight}, seq_len, decay}]: new weights (or the stage "
                                    "before's) and optionally a new seq_len (as data.seq_len) from a step on; decay: "
                                    "true starts train.decay=wsd's decay at that step (docs/data.md)", None)
    seq_len: int | None = described("the length stage 0 trains at (until a data.stages entry sets its seq_len): a "
                                    "divisor of model.max_seq_len; each sample of max_seq_len is cut into rows of it, "
                                    "a step keeping its tokens (docs/data.md). null = model.max_seq_len", None)
    canonical_streams: int | None = described("C, the canonical streams of the sample order (tokendata/order.py): "
                        "global batch g holds the same samples, in the same order, on every data-parallel size that "
                        "divides the global batch, any worker count and micro-batch. 1 ≤ C ≤ train.global_batch_size; "
                        "a rank reads the streams of its part of each batch (about C/dp + 2): more streams, fewer "
                        "ranks sharing a stream's shards at a large dp, more shards on a rank's disk at a small one. "
                        "It cannot change within a run. null = min(64, global batch), or a checkpoint's", None)
    tokenizer: str | None = described("path or URL of the tokenizer (a sentencepiece tokenizer.model, or a Hugging "
                               "Face tokenizer.json with its tokenizer_config.json beside it); default the one beside "
                               "the shards (of the first source) that their manifest.json names", None)
    cache_dir: str | None = described("a local folder that keeps a copy of each shard read from a URL (keyed by source, "
                               "name and size), so later epochs and relaunches read the disk; default none (the shards "
                               "being read lie in a temporary folder)", None)
    fetch_threads: int = described("shards a rank fetches at once (threads, shared by its DataLoader workers, at "
                                   "least 1 each): the shards it holds in memory are at most these; the ones being "
                                   "read lie on the local disk (docs/data.md: the bounds)", 8)
    num_workers: int = described("DataLoader worker processes per rank (0 = read in the training process; at most "
                                 "as many as the rank's canonical streams are used)", 2)
    seed: int = described("seed of the shard/sample order", 1234)
    val_batches: int = described("validation micro-batches per evaluation, of each source (the same batches every "
                                 "time)", 20)
    bad_shards: str = described("a truncated, empty or unreadable shard: 'fail' (stop with an error naming it) or 'skip' "
                         "(train without it; logged and counted)", "fail")
    verify: str = described("what is checked of each shard when it is read (nothing is requested per shard before "
                     "training): 'hash' (its size and content hash: a mismatch is fetched again past data.cache_dir, "
                     "then is a bad shard), 'size' (its size and structure), 'none' (the structure only)", "hash")
    ca_bundle: str | None = described("PEM file of the CA certificates that https:// shard servers are verified against "
                               "(the size check, shards, manifest, tokenizer); default the system's (which honours "
                               "SSL_CERT_FILE). Verification is never switched off", None)
    http_headers_from_env: dict | None = described("headers sent with every http(s):// request, each value read from "
                                            "an environment variable, e.g. {Authorization: SHARDS_TOKEN} with "
                                            "SHARDS_TOKEN='Bearer …' exported: only the variable's name is kept "
                                            "(config, run directory, checkpoints, logs). Refused for http:// "
                                            "sources unless data.headers_over_http", None)
    headers_over_http: bool = described("send data.http_headers_from_env to plain http:// sources too, unencrypted "
                                        "(a network you trust); default false: such a source is refused", False)

    def __post_init__(self):
        check_types(self, "data")
        if self.shard_dir is None and self.sources is None:
            raise ConfigError("missing required config key 'data.shard_dir' (one shard set) or 'data.sources' (a "
                              "blend: [{name, path, weight}])")
        if self.shard_dir is not None and self.sources is not None:
            raise ConfigError("set data.shard_dir (one shard set) or data.sources (a blend), not both")
        need(self.shard_dir is None or bool(self.shard_dir), "data.shard_dir", self.shard_dir, "a directory path")
        try:
            if self.sources is not None:
                self.sources = [{"name": s.name, "path": s.path, "weight": s.weight} for s in as_sources(self.sources)]
            check_joined(self.sources or [], self.stage_list())
        except DataError as e:
            raise ConfigError(str(e)) from None
        need(self.seq_len is None or self.seq_len >= 1, "data.seq_len", self.seq_len, "null or ≥ 1")
        need(self.canonical_streams is None or self.canonical_streams >= 1, "data.canonical_streams",
             self.canonical_streams, "null or ≥ 1")
        for key, low in (("num_workers", 0), ("fetch_threads", 1), ("val_batches", 1)):
            need(getattr(self, key) >= low, f"data.{key}", getattr(self, key), f"≥ {low}")
        need(self.bad_shards in ("fail", "skip"), "data.bad_shards", self.bad_shards, "fail, skip")
        need(self.verify in ("hash", "size", "none"), "data.verify", self.verify, "hash, size, none")
        need(all(isinstance(k, str) and isinstance(v, str) and v.isidentifier()
                 for k, v in (self.http_headers_from_env or {}).items()), "data.http_headers_from_env",
             self.http_headers_from_env, "{header: NAME of an environment variable}, e.g. {Authorization: SHARDS_TOKEN}")
        plain = [(key, path) for key, path in self.paths() if path.startswith("http://")]
        if self.http_headers_from_env and plain and not self.headers_over_http:
            key, path = plain[0]
            raise ConfigError(f"{key}={path} is plain http://: data.http_headers_from_env "
                              f"({', '.join(self.http_headers_from_env)}) would go out unencrypted; serve it over "
                              f"https://, or set data.headers_over_http=true on a network you trust")

    def stage_list(self) -> list[tuple[int, list[float]]]:
        """data.stages as [(first step, [weight of each source])] (tokendata/sources.py `as_stages`)."""
        named = self.sources or [{"name": None, "weight": 1.0}]
        return as_stages(self.stages, [s["name"] for s in named], [s["weight"] for s in named])

    def paths(self) -> list[tuple[str, str]]:
        """(dotted key, location) of every source."""
        if self.sources is None:
            return [("data.shard_dir", self.shard_dir)]
        return [(f"data.sources[{i}].path", s["path"]) for i, s in enumerate(self.sources)]

    def source_list(self) -> str | list[Source]:
        """What tokendata reads: the shard_dir, or the sources (tokendata/sources.py)."""
        return self.shard_dir if self.sources is None else [Source(**s) for s in self.sources]


@dataclass(kw_only=True)
class ParallelSection:
    """How ranks are split: world = tp × cp × pp × dp, dp derived from the world size at launch (`dp()`)."""
    tp: int = described("tensor-parallel size: heads (and every per-head synthesizer weight) are split over tp ranks", 1)
    cp: int = described("context-parallel size: each sequence split into 2·cp chunks over cp ranks (model/context.py; "
                        "max_seq_len % (2·cp) = 0)", 1)
    pp: int = described("pipeline stages (DeepSpeed PipelineModule); layers are split over them", 1)
    zero_stage: int = described("DeepSpeed ZeRO stage over the data-parallel group: 0 (off), 1 (optimizer states), "
                         "2 (+ gradients), 3 (+ parameters)", 1)
    partition: str = described("how pipeline stages split the layers: 'parameters' (balance parameter counts) or "
                        "'uniform' (balance layer counts)", "parameters")
    sequence_parallel: bool = described("tp > 1: norms, dropouts, residuals, loss input on n/tp positions a rank (Megatron's"
                                        "; max_seq_len % tp = 0, % 2·cp·tp under cp); off: slower at tp 2 on gloo "
                                        "(docs/DESIGN.md §2)", False)
    activation_checkpointing: int = described("recompute activations in backward: 0 = off, 1 = every layer, "
                                       "k = every k-th layer (layers 0, k, 2k, …)", 0)
    cpu_keep_freed_memory: bool = described("CPU runs: malloc keeps freed memory in the process (faster steps, no page "
                                     "faults; resident memory grows by what the heap fragments)", True)

    def __post_init__(self):
        check_types(self, "parallel")
        need(self.tp >= 1, "parallel.tp", self.tp, "≥ 1")
        need(self.cp >= 1, "parallel.cp", self.cp, "≥ 1")
        need(self.pp >= 1, "parallel.pp", self.pp, "≥ 1")
        need(self.zero_stage in (0, 1, 2, 3), "parallel.zero_stage", self.zero_stage, "0, 1, 2 or 3")
        need(self.partition in ("parameters", "uniform"), "parallel.partition", self.partition,
              "parameters, uniform")
        need(self.activation_checkpointing >= 0, "parallel.activation_checkpointing",
              self.activation_checkpointing, "0 (off) or k ≥ 1 (every k-th layer)")
        # Within one section, so checked here rather than at launch: DeepSpeed's PipelineEngine refuses ZeRO-2/3.
        if self.pp > 1 and self.zero_stage > 1:
            raise ConfigError(f"parallel.pp > 1 needs parallel.zero_stage ≤ 1 (got pp={self.pp}, "
                              f"zero_stage={self.zero_stage}); DeepSpeed pipelines support ZeRO-0/1 only")

    def dp(self, world_size: int) -> int:
        """Data-parallel size: the ranks left after tensor, context and pipeline parallelism."""
        model_ranks = self.tp * self.cp * self.pp
        if world_size < 1 or world_size % model_ranks:
            raise ConfigError(f"world size {world_size} is not divisible by parallel.tp × parallel.cp × parallel.pp = "
                              f"{self.tp} × {self.cp} × {self.pp} = {model_ranks}")
        return world_size // model_ranks


@dataclass(kw_only=True)
class TrainSection:
    """Optimizer (AdamW), schedule (warmup + decay, see `lr_lambda`), batch sizes, length and numerics of the run."""
    lr: float = described("peak learning rate, reached at the end of warmup", 3e-4)
    min_lr: float = described("learning rate at train.max_steps and after (GPT-3: lr/10)", 3e-5)
    warmup_steps: int = described("linear warmup from 0 to lr over this many optimizer steps", 100)
    decay: str = described("after warmup: 'cosine' (to min_lr at max_steps), 'linear', 'constant' (stay at lr), or "
                           "'wsd' (warmup-stable-decay: stay at lr, then fall to min_lr over the last "
                           "train.decay_steps in train.decay_shape; tools/branch.py starts such a decay from any "
                           "checkpoint of the stable phase)", "cosine")
    decay_steps: int | None = described("with decay 'wsd': the decay phase, the last this many optimizer steps of the "
                                        "run (ending at max_steps, or where max_tokens ends it); null = "
                                        "train.decay_fraction of them", None)
    decay_fraction: float = described("with decay 'wsd' and decay_steps null: the decay phase as a fraction of the "
                                      "run's steps, rounded (MiniCPM and Hägele et al. 2024 decay over 10-20%)", 0.2)
    decay_shape: str = described("with decay 'wsd': how the decay phase falls from lr to min_lr, p its progress 0 → 1: "
                                 "'linear' (1 − p), 'cosine' (½(1 + cos πp)) or '1-sqrt' (1 − √p: Hägele et al. 2024 "
                                 "found it the best of these)", "1-sqrt")
    weight_decay: float = described("AdamW decoupled weight decay", 0.1)
    betas: tuple[float, float] = described("AdamW (beta1, beta2)", (0.9, 0.95))
    eps: float = described("AdamW epsilon", 1e-8)
    grad_clip: float = described("clip the global gradient norm to this (0 = no clipping)", 1.0)
    global_batch_size: int = described("sequences per optimizer step summed over all data-parallel ranks")
    micro_batch_size: int = described("sequences per rank per forward/backward pass")
    max_steps: int = described("optimizer steps of the run (the cosine reaches min_lr here)")
    batch_ramp: dict | None = described("{start, increment, tokens}: the global batch starts at `start` and grows by "
                                        "`increment` in equal parts of the first `tokens` to global_batch_size "
                                        "(Megatron-LM's --rampup-batch-size); each size must divide by micro_batch_size "
                                        "× dp; not with pp > 1. The LR schedule then runs in tokens: warmup_steps and "
                                        "decay_steps count steps of the full batch (docs/recipes.md). null: no ramp",
                                        None)
    max_tokens: int | None = described("optional token budget (global_batch_size × max_seq_len per step); the run stops "
                                "at whichever of max_steps / max_tokens comes first", None)
    precision: str = described("'fp32', 'bf16' (mixed, fp32 master weights) or 'fp16' (CUDA only, dynamic loss scale)",
                        "fp32")
    master_weights: str = described("with precision bf16 and ZeRO-1/2: 'fp32' master weights and AdamW moments (the "
                                    "default), or 'bf16' for all of them (DeepSpeed's bf16_master_weights_and_grads: "
                                    "half the optimizer's memory traffic, but updates below bf16's resolution of a "
                                    "weight are lost)", "fp32")
    autocast: bool = described("with precision bf16 and ZeRO-0: keep the weights, gradients and AdamW moments in "
                               "fp32 and run the forward in bf16 through torch.autocast (DeepSpeed's torch_autocast), "
                               "as a plain PyTorch loop does: no bf16 weights beside an fp32 master copy, so no cast "
                               "of every weight after each step and none of ZeRO's per-gradient copies; for layouts "
                               "where ZeRO saves nothing (one data-parallel rank) or memory is not the limit "
                               "(across ranks it all-reduces fp32 gradients)", False)
    compile: bool = described("torch.compile each transformer block for the training steps (one graph per block, as "
                              "torchtitan does), and with pp 1 the embedding and the final norm + head + fused loss "
                              "(a graph each); names and checkpoints unchanged; evaluation, samples and maps run "
                              "eager; the first steps pay the compile", False)
    fp8: str | None = described("FP8 training of the linears through torchao (pretrain/float8.py): the plain ones, "
                                "and under tp > 1 megatron's tensor-parallel ones (scales per shard), any pp; null "
                                "(off), 'tensorwise' (one dynamic scale per tensor) or 'rowwise' (one per row: more "
                                "accurate, slower); needs train.precision=bf16, a CUDA GPU of compute capability ≥ 8.9 "
                                "(H100, H200, L40S), pip install 'synthformer[fp8]', and train.compile=true to be fast",
                                None)
    seed: int = described("seed of the trainer's RNGs (dropout); model init uses model.seed", 1234)
    stop_after_steps: int | None = described("end this invocation after this many more optimizer steps, with a checkpoint; "
                                      "the schedule still runs to max_steps (time-limited jobs: relaunch to go on)",
                                      None)
    run_dir: str = described("output directory of the run; checkpoints and TensorBoard go under it by default")
    max_wall_minutes: float | None = described("stop cleanly (checkpoint, exit 0) once this much wall time has passed, for "
                                        "time-limited jobs; relaunch to continue", None)
    hang_timeout: float | None = described("seconds without progress (a finished step, validation, samples, downstream "
                                    "scores, checkpoint save or compilation) after which each rank writes its threads' stacks to "
                                    "<run_dir>/hang/rank<k>.txt and exits non-zero, for launch/pretrain.sh "
                                    "--max-restarts to relaunch; above the slowest save or validation; null: never",
                                    None)
    collective_timeout: float | None = described("seconds a collective may wait, on every process group (world, TP, PP, "
                                    "DP, DeepSpeed's pipeline groups), before it fails; above hang_timeout + "
                                    f"{MIN_MARGIN_S}, so that the watchdog acts first. null: hang_timeout + "
                                    f"{MARGIN_S}, or {WITHOUT_WATCHDOG_S} without a hang_timeout "
                                    "(pretrain/timeouts.py)", None)
    preempt_signals: tuple[str, ...] = described("signals that stop the run cleanly after the current step with a "
                                          "checkpoint and exit 0 (SLURM sends SIGTERM, or SIGUSR1 with --signal)",
                                          ("SIGTERM", "SIGUSR1"))
    init_from: str | None = described("release directory (tools/convert.py) whose weights start a fresh run, in any layout; "
                               "its training step carries on (LR schedule, data position). A checkpoint of this run "
                               "takes precedence when resuming", None)
    max_consecutive_skips: int = described("stop with an error after this many optimizer steps in a row were skipped "
                                    "(non-finite loss or gradient, loss spike); 0 = never stop", 8)
    spike_z: float | None = described("skip a step whose loss exceeds mean + spike_z × std of the last spike_window kept "
                               "steps (null = no spike rule; not with parallel.pp > 1)", None)
    spike_window: int = described("steps in the window of the loss-spike rule", 100)

    def weights_precision(self) -> str:
        """The dtype the engine keeps the model's weights in: `precision`, except under `autocast`, where they stay
        fp32 and only the forward's operations run in bf16."""
        return "fp32" if self.autocast else self.precision

    def __post_init__(self):
        check_types(self, "train")
        need(self.lr > 0, "train.lr", self.lr, "> 0")
        need(0 <= self.min_lr <= self.lr, "train.min_lr", self.min_lr, f"0 ≤ min_lr ≤ train.lr={self.lr}")
        need(self.max_steps >= 1, "train.max_steps", self.max_steps, "≥ 1")
        need(0 <= self.warmup_steps <= self.max_steps, "train.warmup_steps", self.warmup_steps,
              f"0 ≤ warmup_steps ≤ train.max_steps={self.max_steps}")
        check_decay(self)   # train.decay and its wsd keys (pretrain/config/schedule.py)
        check_ramp(self)    # train.batch_ramp (pretrain/config/batch_ramp.py)
        need(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "≥ 0")
        need(all(0 <= b < 1 for b in self.betas), "train.betas", list(self.betas), "each in [0, 1)")
        need(self.eps > 0, "train.eps", self.eps, "> 0")
        need(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "≥ 0 (0 = off)")
        need(self.global_batch_size >= 1, "train.global_batch_size", self.global_batch_size, "≥ 1")
        need(1 <= self.micro_batch_size <= self.global_batch_size, "train.micro_batch_size",
              self.micro_batch_size, f"1 … train.global_batch_size={self.global_batch_size}")
        need(self.stop_after_steps is None or self.stop_after_steps >= 1, "train.stop_after_steps",
              self.stop_after_steps, "null or ≥ 1")
        need(self.max_tokens is None or self.max_tokens >= 1, "train.max_tokens", self.max_tokens, "null or ≥ 1")
        need(self.precision in ("fp32", "bf16", "fp16"), "train.precision", self.precision, "fp32, bf16, fp16")
        need(self.master_weights in ("fp32", "bf16"), "train.master_weights", self.master_weights, "fp32, bf16")
        if self.master_weights == "bf16" and self.precision != "bf16":
            raise ConfigError(f"train.master_weights='bf16' needs train.precision='bf16' (it is "
                              f"{self.precision!r}); set both, or master_weights=fp32")
        if self.autocast and (self.precision != "bf16" or self.master_weights != "fp32"):
            raise ConfigError(f"train.autocast=true needs train.precision='bf16' and train.master_weights='fp32' (they "
                              f"are {self.precision!r}, {self.master_weights!r}); set them, or train.autocast=false")
        need(self.fp8 in (None, "tensorwise", "rowwise"), "train.fp8", self.fp8, "null, tensorwise, rowwise")
        if self.fp8 is not None and self.precision != "bf16":
            raise ConfigError(f"train.fp8={self.fp8!r} needs train.precision='bf16' (it is {self.precision!r}): the "
                              f"FP8 matmuls' inputs and outputs are bf16; set train.precision=bf16")
        need(bool(self.run_dir), "train.run_dir", self.run_dir, "a directory path")
        need(self.max_wall_minutes is None or self.max_wall_minutes > 0, "train.max_wall_minutes",
              self.max_wall_minutes, "null or > 0")
        need(self.hang_timeout is None or self.hang_timeout > 0, "train.hang_timeout", self.hang_timeout,
             "null or > 0 (seconds)")
        floor = 0 if self.hang_timeout is None else self.hang_timeout + MIN_MARGIN_S
        need(self.collective_timeout is None or self.collective_timeout > floor, "train.collective_timeout",
             self.collective_timeout, f"null or > {floor:g} s" + (f" (train.hang_timeout={self.hang_timeout:g} + "
                                                                  f"{MIN_MARGIN_S}: the watchdog must act first)"
                                                                  if self.hang_timeout is not None else ""))
        need(all(s in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT") for s in self.preempt_signals),
              "train.preempt_signals", self.preempt_signals, "a list of SIGTERM, SIGUSR1, SIGUSR2, SIGINT")
        need(self.max_consecutive_skips >= 0, "train.max_consecutive_skips", self.max_consecutive_skips,
              "≥ 0 (0 = never stop)")
        need(self.spike_z is None or self.spike_z > 0, "train.spike_z", self.spike_z, "null or > 0")
        need(self.spike_window >= 2, "train.spike_window", self.spike_window, "≥ 2")

    def grad_accum(self, dp: int) -> int:
        """Micro-batches per rank per optimizer step: global = micro × accumulation × dp."""
        per_step, G = self.micro_batch_size * dp, self.global_batch_size
        if G % dp:   # the data order reads any divisor of the global batch (tokendata/order.py)
            sizes = ", ".join(str(d) for d in range(1, min(G, 4096) + 1) if G % d == 0)
            raise ConfigError(f"train.global_batch_size={G} is not divisible by the data-parallel size {dp}: its "
                              f"samples are split evenly over the ranks; data-parallel sizes it can use: {sizes}")
        if self.global_batch_size % per_step:
            raise ConfigError(f"train.global_batch_size={self.global_batch_size} is not divisible by "
                              f"train.micro_batch_size × data-parallel size = {self.micro_batch_size} × {dp} = "
                              f"{per_step}")
        return self.global_batch_size // per_step


@dataclass(kw_only=True)
class LoggingSection:
    """What goes to the console and TensorBoard, and how often."""
    every: int = described("log loss, lr, grad norm, tokens/s and MFU every this many steps", 10)
    val_every: int = described("validate every this many steps (0 = only at the end)", 500)
    image_every: int = described("attention-map images and a text sample every this many steps (0 = never)", 1000)
    tensorboard_dir: str | None = described("TensorBoard event directory; default <train.run_dir>/tensorboard", None)
    peak_tflops_per_device: float | None = described(
        "peak dense TFLOP/s of one device at train.precision, the denominator of MFU; null = from the device's name "
        "(pretrain/observe/device_peaks.py PEAK_TFLOPS: H100 bf16 989, A100 312, ...); on a CPU or an unknown GPU MFU is then n/a",
        None)
    sample_prompt: str | None = described("prompt of the text sample in TensorBoard; null = the opening words of the "
                                          "first document of the run's validation data", None)
    sample_tokens: int = described("tokens generated for the text sample", 64)
    sample_ids: bool = described("write each step's sample ids to <run_dir>/sample_ids/rank<R>.jsonl (audits, tests)", False)
    cluster: str | None = described("the cluster this run's predicted step is for (pretrain/plan/: the launch line and "
                                    "perf/measured_over_predicted): a preset (h100, h200, a100, cpu) or a cluster YAML "
                                    "file; null = the preset of the device's name", None)
    wandb: WandbSection | None = described("Weights & Biases beside TensorBoard, from rank 0, the same scalars, images "
                                           "and text: {project, entity, mode, tags} (the keys below); a relaunch "
                                           "resumes the same W&B run (its id in <run_dir>/wandb-run-id). null = off; "
                                           "needs pip install 'synthformer[wandb]'", None)
    eval_tasks: tuple[str, ...] = described("lm-eval tasks scored on the live weights every logging.eval_every steps, "
                                            "logged as eval/<task>/<metric>: the shipped austen_cloze, austen_mc4, or "
                                            "any lm-eval task available offline; needs pip install "
                                            "'synthformer[eval]'", ())
    eval_every: int = described("score logging.eval_tasks every this many steps (0 = only at the end of the run)", 0)
    eval_batch_size: int = described("sequences per forward pass of the scoring", 32)
    eval_limit: int | None = described("score only the first this many documents of each task (null = all)", None)
    profile: ProfileSection | None = described("torch.profiler windows inside the run, {start, steps, ranks, every, "
                                               "memory} (the keys below): each window writes <run_dir>/profile/steps_"
                                               "<a>-<b>/rank<k>.pt.trace.json (Perfetto, chrome://tracing, "
                                               "TensorBoard's profiler plugin), and on CUDA with memory: true "
                                               "rank<k>.memory.pickle (pytorch.org/memory_viz). null = off, at no "
                                               "cost (docs/monitoring.md)", None)

    def __post_init__(self):
        check_types(self, "logging")
        for name in ("every", "val_every", "image_every", "sample_tokens"):
            low = 1 if name == "every" else 0
            need(getattr(self, name) >= low, f"logging.{name}", getattr(self, name), f"≥ {low}")
        need(self.eval_every >= 0, "logging.eval_every", self.eval_every, "≥ 0 (0 = only at the end)")
        need(self.eval_batch_size >= 1, "logging.eval_batch_size", self.eval_batch_size, "≥ 1")
        need(self.eval_limit is None or self.eval_limit >= 1, "logging.eval_limit", self.eval_limit, "null or ≥ 1")
        need(self.peak_tflops_per_device is None or self.peak_tflops_per_device > 0,
              "logging.peak_tflops_per_device", self.peak_tflops_per_device, "null (from the device) or > 0")


@dataclass(kw_only=True)
class WandbSection:
    """logging.wandb: the W&B run that mirrors TensorBoard (pretrain/monitor.py WandbRun)."""
    project: str = described("the W&B project")
    entity: str | None = described("the W&B team or user; default your default entity", None)
    mode: str = described("online, offline (a directory per launch under <run_dir>/wandb, for `wandb sync`) or "
                          "disabled", "online")
    tags: tuple[str, ...] = described("tags of the W&B run", ())

    def __post_init__(self):
        check_types(self, "logging.wandb")
        need(bool(self.project), "logging.wandb.project", self.project, "a W&B project name")
        need(self.mode in ("online", "offline", "disabled"), "logging.wandb.mode", self.mode,
             "online, offline, disabled")


@dataclass(kw_only=True)
class ProfileSection:
    """logging.profile: torch.profiler windows inside the run (pretrain/observe/profiler.py ProfileWindows)."""
    start: int = described("the first optimizer step of the window (the step before it runs as the profiler's "
                           "warm-up)")
    steps: int = described("optimizer steps in the window", 3)
    ranks: tuple[int, ...] = described("the global ranks that record it (each writes its own files)", (0,))
    every: int | None = described("a window each this many steps from start (more than steps); null: one", None)
    memory: bool = described("CUDA: also record the allocator's history and dump a memory snapshot (and one on an "
                             "out-of-memory error inside the window)", False)

    def __post_init__(self):
        check_types(self, "logging.profile")
        need(self.start >= 1, "logging.profile.start", self.start, "the first optimizer step of the window, ≥ 1")
        need(self.steps >= 1, "logging.profile.steps", self.steps, "≥ 1")
        need(all(r >= 0 and not isinstance(r, bool) for r in self.ranks), "logging.profile.ranks", list(self.ranks),
             "a list of global ranks, e.g. [0, 8]")
        need(self.every is None or self.every > self.steps, "logging.profile.every", self.every,
             "null (one window) or more than logging.profile.steps")
