"""Activation memory of one training micro-batch, per rank, from the model config: what each layer keeps for
backward, named, and the largest temporary of the forward pass.

Legend: B micro-batch, n sequence length, N = B·n tokens, d width, H heads (Hl = H/tp on a rank), d_h = d/H, f a
q·k feature width, V vocabulary, a the activation dtype's bytes (4 fp32; 2 bf16/fp16, DeepSpeed casts the module).

Every count comes from the real modules: each synthesizer's fused form (`fused(x, inputs)` on a meta input of the whole model,
model/accounting.py's `shape_model`) gives its feature widths, whether a member's keys are shared by the batch and
whether it has a per-key bias; each synthesizer names what it keeps itself (`activations(B, n, mixed)`). What the
kernels keep (model/kernels.py, model/gpu_kernels/), per layer:
    q·k members (dot, dense, factorized_random and their mixtures), one SDPA call: q, k, v, out at the common width
        W (v's, or f rounded up to 8 when the concatenated features are wider: dense+dot's 2·d_h + 1 bias column),
        its logsumexp (fp32); on the GPU where f fills 256 beside a key bias, SDPA keeps q, k, the values [e ⊙ v, e]
        and out at f and v itself, or, with the key-bias kernel (SYNTHFORMER_KEY_BIAS_KERNEL=triton), q at f, the
        per-sample keys (dot's, not W_2's), v and out at d_h (model/qk_attention.py)
    a map beside q·k members (random+dot): the same, block by block (CPU) or a Triton kernel (GPU): nothing n²
    maps alone (random, factorized_random): the values with the batch in their columns and the output; on a GPU
        also the softmax of the map, Hl·n² ("random's H·n² maps": one per layer, shared by the batch)
    factors (factorized_dense): A, B, v, out
    then the output projection's input (a copy where the kernel's output is not laid out as (B, n, Hl·d_h)).
Under the document mask (model.document_mask, model/documents.py; `document_attention_terms`), per layer:
    q·k members alone, CPU: one SDPA call with the mask, as above but every key per sample (dense's W_2[p_j], R_2[p_j])
    a map or factors among the members, CPU: the whole per-sample logits are made and their softmax A, B·Hl·n², is
        kept (the map differs per sample: "one for the batch" no longer holds), with the values (contiguous) and the
        q·k features that enter it
    GPU path (any synthesized attention): one compiled FlexAttention call: q, k (16 zero features where no q·k
        member), v, out, log-sum-exp; nothing n²
    SGU: W[p_i, p_j] masked per sample, B·H·n², on either path
and once per forward pass (per block in a pipeline, whose blocks each make their own): the positions in the documents
(int64), the mask M (B·n², the activations' dtype) on the CPU path with synthesized attention, its booleans where an
SGU masks with them, and the BlockMask's tile indices on the GPU path.
Beside the mixer: two layer norms (input + fp32 statistics), the MLP's input, pre- and post-GELU hidden (d_ffn/tp
each), dropout masks where dropout is on (booleans on a GPU, the
activations' dtype on a CPU). Under sequence parallelism (`sp` = tp) the norms' inputs, the residual dropout masks
and a checkpointed block's input hold n/tp positions. The head's fused cross-entropy (model/linear_cross_entropy.py)
keeps its two gradients, ∂x (N·d) and ∂W (V/tp·d, fp32), and its forward's largest temporary is one chunk of fp32
logits (CHUNK_ELEMENTS); under pipeline parallelism the last stage materializes the logits (B·n·V/tp) and their
log-softmax in fp32. Activation checkpointing keeps a checkpointed block's input only, and recomputes one block at a
time in backward (its activations come back while it runs).
"""
from __future__ import annotations

import functools
import json
from typing import NamedTuple

import torch

from .accounting import shape_model
from .config import ModelConfig
from .forms import FactorForm, MapForm, QKForm
from .linear_cross_entropy import CHUNK_ELEMENTS
from .mixers import SynthesizedAttention
from .parallel import joint_column
from .qk_attention import SDPA_MAX_WIDTH, key_bias_kernel

FP32, INDEX = 4, 8


class Term(NamedTuple):
    name: str
    bytes: int


def _width(f: int, d_h: int) -> int:
    """The common width of q, k, v on the SDPA path (model/qk_attention.py _common_width)."""
    return d_h if f <= d_h else -(-f // 8) * 8


def _forms(mixer: SynthesizedAttention, B: int, n: int, documents: bool = False) -> list:
    x = torch.empty(B, n, mixer.value.weight.shape[1], device="meta")
    layers = [mixer.value] + [layer for synth in mixer.synth.values() for layer in synth.projections()]
    inputs = dict(zip(layers, joint_column(x, layers)))
    if documents:
        p = torch.zeros(B, n, dtype=torch.long, device="meta")
        return [synth.fused(x, inputs, p) for synth in mixer.synth.values()]
    return [synth.fused(x, inputs) for synth in mixer.synth.values()]


def attention_terms(mixer: SynthesizedAttention, B: int, n: int, tp: int, a: int, gpu: bool) -> list[Term]:
    """What a synthesized-attention mixer keeps for backward on one rank (per rank: heads / tp)."""
    H, d_h = mixer.value.weight.shape[0] // mixer.d_h, mixer.d_h
    Hl, N, mixed = H // tp, B * n, len(mixer.names) > 1
    out = []
    for name, synth in mixer.synth.items():   # each member's own intermediates (dense's hidden features, ...)
        out += [Term(f"{name}: {what}", a * count // tp) for what, count in synth.activations(B, n, mixed).items()]
    forms = _forms(mixer, B, n)
    head_rows = N * Hl                       # (B, Hl, n) rows of one feature each
    values = a * head_rows * d_h
    value_term = Term("values V = X W_v", values)
    copy_out = True                          # the output projection's input is a copy of the kernel's output
    if isinstance(forms[0], FactorForm):
        out += [value_term, Term("attention output (laid out as V: no copy for the output projection)", values)]
        copy_out = False
        if gpu:
            out.append(Term("row log-sum-exp (fp32)", FP32 * head_rows))
    elif not any(s.input_dependent for s in mixer.synth.values()):   # one map for the batch
        out.append(Term("values and output with the batch in the columns", 2 * values))
        maps = any(isinstance(form, MapForm) for form in forms)
        if gpu or (mixed and maps):   # GPU: the map's softmax; CPU: the map weighted by α (the kernel's input)
            what = "softmax of the map" if gpu else "the map weighted by α"
            out.append(Term(f"{what}, Hl·n² = {Hl}·{n}² (one for the batch)", a * Hl * n * n))
        f = sum(form.q.shape[-1] for form in forms if isinstance(form, QKForm))
        if f:
            out.append(Term(f"factors R_1, R_2 (weighted and) concatenated, {f} wide", 2 * a * Hl * n * f))
    else:
        qk = [f for f in forms if isinstance(f, QKForm)]
        f = sum(form.q.shape[-1] for form in qk)
        key_bias = any(form.key_bias is not None for form in qk)
        shared_k = len(qk) == 1 and qk[0].k.shape[0] == 1
        has_map = any(isinstance(form, MapForm) for form in forms)
        wide = gpu and not has_map and key_bias and f + 1 > SDPA_MAX_WIDTH >= f   # b fits no column
        if wide and key_bias_kernel() == "triton":   # the groups apart, shared keys a view of W_2, v at d_h
            f_shared = sum(form.k.shape[-1] for form in qk if form.k.shape[0] == 1)
            out += [Term(f"q·k features: q at width {f}, the per-sample keys at {f - f_shared}",
                         a * head_rows * (2 * f - f_shared)), value_term,
                    Term("attention output (laid out as V: no copy for the output projection) and row log-sum-exp",
                         values + FP32 * head_rows)]
            copy_out = False
        elif wide:   # SDPA, b on the values: [e ⊙ v, e] padded to f, kept with v; the quotient's output copied
            out += [Term(f"concatenated q·k features at width {f} (q, k)", a * 2 * head_rows * f), value_term,
                    Term(f"values [e ⊙ v, e] padded to width {f}", a * head_rows * f),
                    Term(f"attention output (width {f}) and row log-sum-exp", a * head_rows * f + FP32 * head_rows)]
        else:
            if gpu and has_map:   # Triton: no padding, k per sample
                width, v_width, k_rows, copy_out = f, d_h, head_rows, True
            else:
                width = _width(f + key_bias, d_h)
                v_width, k_rows = width, head_rows // B if shared_k and not gpu else head_rows
                copy_out = width != d_h
            what = "concatenated q·k features" if len(qk) > 1 or key_bias else "q, k"
            out.append(Term(f"{what} at width {width} (q, k)", a * (head_rows + k_rows) * width))
            out.append(Term(f"values padded to width {v_width}", a * head_rows * v_width) if v_width != d_h
                       else value_term)
            out.append(Term(f"attention output (width {v_width}) and row log-sum-exp",
                            a * head_rows * v_width + FP32 * head_rows))
        if wide:
            out.append(Term("the key bias (α·b_2, or e^{b − max b} on the values)", a * Hl * n))
    if copy_out:
        out.append(Term("output projection input", values))
    if mixer.dropout:
        out.append(Term("mixer dropout mask", mask_bytes(a, gpu) * head_rows * d_h))
    return out


def document_attention_terms(mixer: SynthesizedAttention, B: int, n: int, tp: int, a: int, gpu: bool) -> list[Term]:
    """What a synthesized-attention mixer keeps for backward on one rank under the document mask
    (model/documents.py `attention`)."""
    H, d_h = mixer.value.weight.shape[0] // mixer.d_h, mixer.d_h
    Hl, N, mixed = H // tp, B * n, len(mixer.names) > 1
    out = []
    for name, synth in mixer.synth.items():
        out += [Term(f"{name}: {what}", a * count // tp)
                for what, count in synth.activations(B, n, mixed, documents=True).items()]
    forms = _forms(mixer, B, n, documents=True)
    qk = [form for form in forms if isinstance(form, QKForm)]
    f = sum(form.q.shape[-1] for form in qk) + any(form.key_bias is not None for form in qk)   # + the bias column
    head_rows, values = N * Hl, a * N * Hl * d_h
    if gpu:
        width = f or 16
        out += [Term(f"q, k at width {width} (FlexAttention's inputs)", 2 * a * head_rows * width),
                Term("values V", values), Term("attention output and row log-sum-exp", values + FP32 * head_rows),
                Term("output projection input", values)]
    elif len(qk) < len(forms):   # a map or factors: the whole per-sample logits
        out += [Term(f"probabilities A per sample, B·Hl·n² = {B}·{Hl}·{n}²", a * B * Hl * n * n),
                Term("output projection input", values)]
        if learns(mixer):   # dA = dY Vᵀ, and the gather's backward
            out += [Term("values, contiguous for A V", values),
                    Term("the map's or factors' key columns p_j + b·L", INDEX * N)]
        if qk:
            out.append(Term(f"q·k features at width {f}, scaled q and kᵀ", 2 * a * head_rows * f))
    else:   # SDPA with the mask
        width = _width(f, d_h)
        out += [Term(f"q, k at width {width}, every key per sample", 2 * a * head_rows * width),
                Term(f"values padded to width {width}", a * head_rows * width) if width != d_h else
                Term("values V = X W_v", values),
                Term(f"attention output (width {width}) and row log-sum-exp", a * head_rows * width + FP32 * head_rows)]
        if width != f:   # padded features: the output is laid out per head, not as the values' (B, n, Hl, d_h)
            out.append(Term("output projection input", values))
    if mixer.dropout:
        out.append(Term("mixer dropout mask", mask_bytes(a, gpu) * head_rows * d_h))
    return out


def learns(mixer: SynthesizedAttention) -> bool:
    """Whether its map gets a gradient (random_fixed's does not)."""
    return any(p.requires_grad for _, p in mixer.synthesizer_parameters()) or \
        any(s.input_dependent for s in mixer.synth.values())


def document_terms(cfg: ModelConfig, B: int, n: int, a: int, gpu: bool) -> list[Term]:
    """What one set of documents keeps (model/documents.py `Documents`): once a forward pass, or once a block in a
    pipeline."""
    mixers = [block.mixer for block in shape_model(cfg).blocks if isinstance(block.mixer, SynthesizedAttention)]
    sdpa = any(all(isinstance(f, QKForm) for f in _forms(m, 1, 1, documents=True)) for m in mixers)
    out = [Term("positions in the documents (int64)", INDEX * B * n)]
    if gpu and mixers:   # kv and q tile counts and indices, forward and transposed: (B, ⌈n/128⌉²) int32 each
        tiles = -(-n // 128)
        out.append(Term("FlexAttention block mask (tile indices)", 4 * 2 * B * (tiles * tiles + tiles)))
    elif sdpa:   # SDPA keeps M for backward (the whole maps add it and keep only their softmax)
        out.append(Term(f"document mask M, B·n² = {B}·{n}²", a * B * n * n))
    if "sgu" in cfg.layer_mixers() and not gpu:
        out.append(Term("document mask as booleans (SGU)", B * n * n))
    return out


def layer_terms(cfg: ModelConfig, index: int, B: int, n: int, tp: int, a: int, gpu: bool, sp: int = 1) -> list[Term]:
    """Everything block `index` keeps for backward on one rank (blocks of one mixer keep alike: computed once per
    config, shape and GPU kernel choice). `sp`: what the sequence-parallel region's positions divide by (tp under
    parallel.sequence_parallel, else 1): the norms' inputs and the dropout masks hold n/sp positions; the mixer's
    and the MLP's normed inputs are the gathered sequence, kept whole by their column-parallel linears."""
    mixers = cfg.layer_mixers()
    return list(_layer_terms(cfg.key(), mixers.index(mixers[index]), B, n, tp, a, gpu,
                             key_bias_kernel() if gpu else None, sp))


@functools.lru_cache(maxsize=1024)
def _layer_terms(config: str, index: int, B: int, n: int, tp: int, a: int, gpu: bool,
                 kernel: str | None, sp: int = 1) -> tuple[Term, ...]:   # kernel: part of the cache's key
    cfg = ModelConfig.from_dict(json.loads(config))
    block = shape_model(cfg).blocks[index]
    N, d = B * n, cfg.d_model
    norms, share = 1 if block.mlp is None else 2, "" if sp == 1 else f", n/{sp} positions (sequence parallel)"
    out = [Term("layer norm inputs and statistics" + share, norms * (a * N * d + 2 * FP32 * N) // sp),
           Term("normed input of the mixer", a * N * d)]
    if isinstance(block.mixer, SynthesizedAttention):
        terms = document_attention_terms if cfg.document_mask else attention_terms
        out += terms(block.mixer, B, n, tp, a, gpu)
    else:
        out += [Term(f"sgu: {what}", a * count // tp)
                for what, count in block.mixer.activations(B, n, gpu, cfg.document_mask).items()]
        if cfg.document_mask:
            out.append(Term("sgu: the map's key columns p_j + b·L (int64)", INDEX * N))
            if gpu:   # the GPU path's documents carry a block mask only: the layer makes M's booleans itself
                out.append(Term("sgu: document mask as booleans", N * n))
    if block.mlp is not None:
        f = cfg.d_ffn // tp
        out += [Term("normed input of the MLP", a * N * d), Term(f"MLP hidden {f} wide, before and after GELU",
                                                                  2 * a * N * f)]
    if cfg.dropout:
        out.append(Term("residual dropout masks" + share, mask_bytes(a, gpu) * norms * N * d // sp))
    return tuple(out)


def layer_bytes(cfg: ModelConfig, index: int, B: int, n: int, tp: int, a: int, gpu: bool, sp: int = 1) -> int:
    return sum(t.bytes for t in layer_terms(cfg, index, B, n, tp, a, gpu, sp))


def head_terms(cfg: ModelConfig, B: int, n: int, tp: int, a: int, pipeline: bool = False,
               sp: int = 1) -> tuple[list[Term], int]:
    """(what the final norm, head and loss keep; the forward's largest temporary) on one rank; the final norm on
    n/sp positions (`layer_terms`), the head on the gathered sequence."""
    N, d, V = B * n, cfg.d_model, cfg.vocab_size // tp
    kept = [Term("final layer norm input and statistics", (a * N * d + 2 * FP32 * N) // sp)]
    if pipeline:   # the last stage computes the logits, then the loss (model/lm.py Head.loss), kept per micro-batch
        kept.append(Term(f"vocab logits B·n·V/tp = {N}·{V}, and their fp32 log-softmax",
                         a * N * V + FP32 * N * V * (2 if a != FP32 else 1)))
        return kept, FP32 * N * V   # their gradient, in backward

    kept += [Term("fused loss: gradient of its input", a * N * d),
             Term(f"fused loss: gradient of the head weight, fp32 V/tp·d = {V}·{d}", FP32 * V * d)]
    rows = max(1, min(N, CHUNK_ELEMENTS // V))
    chunk = rows * V * (2 * FP32 + (a if a != FP32 else 0)) + a * V * d   # logits, ∂logits (fp32 and cast), Gᵀx
    return kept, chunk


def mask_bytes(a: int, gpu: bool) -> int:
    """Bytes of a dropout mask's element: booleans from the fused kernel of a GPU, the activations' dtype on a CPU
    (torch's unfused dropout keeps x's dtype of noise ∈ {0, 1/(1−p)})."""
    return 1 if gpu else a


def embedding_terms(cfg: ModelConfig, B: int, n: int, sp: int = 1, a: int = FP32, gpu: bool = False) -> list[Term]:
    out = [Term("token ids", INDEX * B * n)]
    if cfg.dropout:
        out.append(Term("embedding dropout mask", mask_bytes(a, gpu) * B * n * cfg.d_model // sp))
    return out


class Activations(NamedTuple):
    """One micro-batch's activations on one rank: `kept` (named terms, in bytes) alive at the end of the forward
    pass, and `transient`, the most that exists beside them for a moment (the loss's chunk of logits, or a
    checkpointed block recomputed in backward)."""
    kept: list[Term]
    transient: Term

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.kept)

    @property
    def peak(self) -> int:
        return self.total + self.transient.bytes


def activations(cfg: ModelConfig, B: int, n: int | None = None, tp: int = 1, a: int = FP32, checkpoint_every: int = 0,
                layers: range | None = None, first: bool = True, last: bool = True, pipeline: bool = False,
                gpu: bool = False, sp: int = 1) -> Activations:
    """The activations of blocks `layers` (default all) and, where `first`/`last`, of the embedding and the head
    (a pipeline stage holds some of them). `checkpoint_every` k > 0: blocks 0, k, 2k, … keep their input only
    (parallel.activation_checkpointing); `gpu`: the GPU path's kernels (model/kernels.py `on_gpu_path`); `sp`: tp
    under sequence parallelism, else 1 (`layer_terms`)."""
    n = n or cfg.max_seq_len
    layers = range(cfg.n_layers) if layers is None else layers
    full_input = a * B * n * cfg.d_model // sp
    kept, recompute = [], Term("nothing", 0)
    if first:
        kept += embedding_terms(cfg, B, n, sp, a, gpu)
    if cfg.document_mask:   # once a pass; in a pipeline each block makes its own
        docs = document_terms(cfg, B, n, a, gpu)
        kept += docs if not pipeline else [Term(f"the documents of each of {len(layers)} blocks",
                                                len(layers) * sum(t.bytes for t in docs))]
    mixers, runs = cfg.layer_mixers(), []   # runs of alike layers: [first, last, what, bytes each]
    for i in layers:
        size = layer_bytes(cfg, i, B, n, tp, a, gpu, sp)
        if checkpoint_every and i % checkpoint_every == 0:
            what, each = f"{mixers[i]}, checkpointed: its input", full_input
            if size > recompute.bytes:
                recompute = Term(f"layer {i} ({mixers[i]}) recomputed in backward", size)
        else:
            what, each = mixers[i], size
        if runs and runs[-1][2:] == [what, each] and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i, what, each])
    for lo, hi, what, each in runs:
        count = hi - lo + 1
        kept.append(Term(f"layer {lo} ({what})" if count == 1 else f"layers {lo}-{hi} ({what}), {count} alike",
                         count * each))
    transient = recompute
    if last:
        head, chunk = head_terms(cfg, B, n, tp, a, pipeline, sp)
        kept += head
        if chunk > transient.bytes:
            transient = Term("the logits' gradient" if pipeline else "the loss's chunk of fp32 logits", chunk)
    return Activations(kept, transient)


def per_layer_summary(cfg: ModelConfig, B: int, n: int, tp: int, a: int, gpu: bool,
                      layers: range | None = None, sp: int = 1) -> dict[str, list[Term]]:
    """{mixer name: one layer's terms} for each distinct mixer among `layers` (the plan's breakdown)."""
    out, mixers = {}, cfg.layer_mixers()
    for i in range(cfg.n_layers) if layers is None else layers:
        if mixers[i] not in out:
            out[mixers[i]] = layer_terms(cfg, i, B, n, tp, a, gpu, sp)
    return out


def bytes_of(dtype: str) -> int:
    """Activation bytes of train.precision."""
    return FP32 if dtype == "fp32" else 2


__all__ = ["Activations", "Term", "activations", "bytes_of", "head_terms", "layer_terms", "per_layer_summary"]
