"""What context parallelism (parallel.cp, model/context.py) changes in the plans: a rank's activations, and the
per-position tensors it gathers from its peers.

Legend: B micro-batch, n sequence length, cp the context-parallel ranks, s = n/(2·cp) a chunk, P = 2s = n/cp the
positions a rank holds, K = Σ t1 = (2cp + 1)·s the keys its two chunks read (chunk r reads (r + 1)·s, chunk
2cp − 1 − r reads (2cp − r)·s: the same sum on every rank), Hl = H/tp heads, d_h head size, F a layer's gathered
width (elements a position), a the activations' bytes.

A rank runs its two chunks through each block on the materialized path (model/mixers.py `_materialized`, as the
decoder does), so per block it keeps:
    per position (P)    everything outside the mixer as model/memory.py counts it at n = P (norms, the MLP, the
                        mixer's normed input, dropout masks), and the mixer's own per-position tensors: each member's
                        intermediates (dense's σ(W_1 X), a dot member's q), the output projection's input; SGU: U X
                        before and after GELU, LN(Z2), the gate, their product
    gathered (K)        what `ContextCache.extend` returns and the map's product keeps: the values V (Hl·d_h), a dot
                        member's keys (Hl·d_h each), SGU's LN(Z2) (its d_in/tp): B·K·F, the chunk's own rows among
                        them; the earlier chunks' rows are the memory cp adds above n/cp positions
    map rows            the softmax A of each chunk's rows, (B or 1)·Hl·s·t1, B where a member reads the input,
                        1 where the map is the batch's (random), and then for B > 1 also its copy over the batch
                        that the broadcast product A V keeps; in a mixture each member's logits S_m as well (α·S_m
                        keeps them), unless they are a view of its parameter (random's R rows); SGU: its W rows
                        (W ⊙ causal) copied over the batch by the same broadcast, B·Hl·s·t1: Σ over the two
                        chunks, ·K
                        at B > 1, a member whose per-sample queries meet keys shared by the batch (dense's
                        σ(W_1 X) against W_2's rows): the broadcast product keeps q made contiguous and the keys
                        copied over the batch, B·Hl·f·(P + K)
    largest temporary   one chunk's logits and their softmax's gradient, 2·(B or 1)·Hl·s·n (the last chunk reads n),
                        and the causal mask the materialized path makes whole, n²·a, before slicing its rows
The ℓ × ℓ weights (random's R, SGU's W, dense's W_2) stay whole on every rank: counted in the model states as
without cp. Under the document mask the map rows are per sample and each chunk's mask (booleans, B·s·t1) is kept:
counted so, not measured.

Traffic (`gathered_bytes`, per layer, per rank): each of the two rounds all-gathers B·s·F·a bytes a rank, sent to
cp − 1 peers; backward sends the gathered tensors' gradients back to their owners (a reduce-scatter, the same
bytes; on gloo an all-reduce of the stacked gradients, twice that). A synthesizer gathers V alone (F = Hl·d_h), dot
K and V (2·Hl·d_h): half the bytes. Where the trainer gives DeepSpeed the dp × cp ranks as its data-parallel group,
gradients are averaged, and ZeRO partitions, over dp·cp ranks (the cp ranks hold the same parameters).
"""
from __future__ import annotations

import functools
import json

import torch

from model.accounting import shape_model
from model.config import ModelConfig
from model.forms import QKForm
from model.memory import (INDEX, Activations, Term, activations, attention_terms, document_attention_terms,
                          layer_bytes)
from model.mixers import SynthesizedAttention


def spans(n: int, cp: int) -> tuple[int, int, int]:
    """(s, P, K): a chunk's positions, a rank's, and the keys its two chunks read together."""
    if n % (2 * cp):
        raise ValueError(f"parallel.cp={cp} splits a sequence into 2·cp = {2 * cp} chunks: model.max_seq_len={n} "
                         f"must be a multiple of {2 * cp}")
    s = n // (2 * cp)
    return s, 2 * s, (2 * cp + 1) * s


def gathered_width(cfg: ModelConfig, index: int, tp: int) -> int:
    """F: the elements a position of block `index` gathers on one TP rank: the values and each cached (dot)
    member's keys, Hl·d_h each; SGU its LN(Z2), d_in/tp."""
    mixer = shape_model(cfg).blocks[index].mixer
    if isinstance(mixer, SynthesizedAttention):
        width = mixer.value.weight.shape[0] // tp                        # Hl·d_h (the meta model: full shapes)
        return width * (1 + sum(synth.cached for synth in mixer.synth.values()))
    return mixer.norm_weight.numel() // tp                               # Hl·c


def gathered_bytes(cfg: ModelConfig, index: int, B: int, n: int, cp: int, tp: int, a: int) -> int:
    """Bytes one rank all-gathers for block `index` in one round (its chunk's rows): B·s·F·a."""
    return B * spans(n, cp)[0] * gathered_width(cfg, index, tp) * a


def sent_per_step(cfg: ModelConfig, B: int, n: int, cp: int, tp: int, a: int, layers: range | None = None) -> dict:
    """Bytes a rank sends per micro-batch for cp, by the formula: {"forward": 2 rounds · (cp − 1) · B·s·F·a per
    layer, "backward": the same (a reduce-scatter of the gradients)}."""
    layers = range(cfg.n_layers) if layers is None else layers
    one = sum(2 * (cp - 1) * gathered_bytes(cfg, i, B, n, cp, tp, a) for i in layers)
    return {"forward": one, "backward": one}


def layer_terms(cfg: ModelConfig, index: int, B: int, n: int, cp: int, tp: int, a: int, gpu: bool,
                sp: int = 1) -> list[Term]:
    """What block `index` keeps for backward on one rank under cp (the module docstring)."""
    return list(_layer_terms(cfg.key(), index, B, n, cp, tp, a, gpu, sp))


@functools.lru_cache(maxsize=512)
def _layer_terms(config: str, index: int, B: int, n: int, cp: int, tp: int, a: int, gpu: bool,
                 sp: int) -> tuple[Term, ...]:
    cfg = ModelConfig.from_dict(json.loads(config))
    mixer, docs = shape_model(cfg).blocks[index].mixer, cfg.document_mask
    s, P, K = spans(n, cp)
    F = gathered_width(cfg, index, tp)
    if isinstance(mixer, SynthesizedAttention):
        fused = (document_attention_terms if docs else attention_terms)(mixer, B, P, tp, a, gpu)
    else:
        fused = [Term(what, a * count // tp) for what, count in mixer.activations(B, P, gpu, docs).items()]
        fused.append(Term("key columns", INDEX * B * P * docs + (B * P * P if docs and gpu else 0)))
    rest = layer_bytes(cfg, index, B, P, tp, a, gpu, sp) - sum(t.bytes for t in fused)
    out = [Term(f"outside the mixer, n/cp = {P} positions", rest)]
    if isinstance(mixer, SynthesizedAttention):
        Hl, d_h, mixed = mixer.value.weight.shape[0] // mixer.d_h // tp, mixer.d_h, len(mixer.names) > 1
        head_rows = B * P * Hl
        out += [Term(f"{name}: {what}", a * count // tp)
                for name, synth in mixer.synth.items() for what, count in synth.activations(B, P, mixed).items()]
        out += [Term(f"{name}: q, kept by q·kᵀ", a * head_rows * d_h)
                for name, synth in mixer.synth.items() if synth.cached and not mixed]
        if B > 1 and not docs:   # q (B, Hl, m, f) against the batch's keys (Hl, t1, f): the broadcast product
            # keeps q made contiguous and the keys copied over the batch (dense's σ(W_1 X) and W_2 rows)
            out += [Term(f"{name}: q contiguous and the batch's keys copied over the batch", a * B * Hl * f * (P + K))
                    for name, f in shared_keys(mixer, cfg.d_model).items()]
        out.append(Term(f"output projection input{' and mixer dropout mask' * bool(mixer.dropout)}",
                        a * head_rows * d_h * (1 + bool(mixer.dropout))))
        batch = B if docs or any(synth.input_dependent for synth in mixer.synth.values()) else 1
        rows = [("softmax A of the chunks' rows", batch)]
        if batch == 1 < B:   # A (1, Hl, s, t1) @ V (B, …): the broadcast matmul keeps A copied over the batch
            rows.append(("the batch's map A copied over the batch by A V", B))
        gathered = "values" + " and the dot member's keys" * any(synth.cached for synth in mixer.synth.values())
        if mixed:   # α·S_m keeps S_m, unless S_m is a view of the member's own parameter (random's R rows)
            rows += [(f"{name}: logits S rows, kept by α", B if docs or synth.input_dependent else 1)
                     for name, synth in mixer.synth.items() if docs or owns_its_logits(synth, cfg.d_model)]
    else:   # W rows (Hl, s, t1) @ LN(Z2) (B, Hl, t1, c): the matmul keeps W's rows copied over the batch
        Hl, batch = mixer.spatial.shape[0] // tp, B
        out.append(Term("sgu: U X before and after GELU, LN(Z2), the gate, their product", a * 7 * B * P * F))
        rows, gathered = [("sgu: W rows ⊙ causal, per sample", batch)], "LN(Z2)"
    out.append(Term(f"gathered {gathered} of keys j < t1, B·K·F = {B}·{K}·{F}", a * B * K * F))
    out += [Term(f"{what}, (B or 1)·Hl·s·K = {b}·{Hl}·{s}·{K}", a * b * Hl * s * K) for what, b in rows]
    if docs:
        out.append(Term("each chunk's document mask (booleans)", B * s * K))
    return tuple(out)


def shared_keys(mixer: SynthesizedAttention, d: int) -> dict[str, int]:
    """{member: its feature width f} of the members whose q·k form pairs per-sample queries with keys shared by the
    batch (dense: σ(W_1 X) against W_2's rows), read off the modules on a meta input of 2 samples."""
    x, out = torch.empty(2, 2, d, device="meta"), {}
    for name, synth in mixer.synth.items():
        form = synth.fused(x, {layer: layer(x) for layer in synth.projections()})
        if isinstance(form, QKForm) and form.q.shape[0] == 2 and form.k.shape[0] == 1:
            out[name] = form.q.shape[-1]
    return out


def owns_its_logits(synth, d: int) -> bool:
    """Whether a member's logits rows are a tensor of their own, not a view of its parameter (random's R rows):
    read off the module on a meta input."""
    S = synth.logits(torch.empty(1, 2, d, device="meta"), 0)
    return S._base is None or not any(S._base is p for p in synth.parameters())


def transient(cfg: ModelConfig, index: int, B: int, n: int, cp: int, tp: int, a: int) -> Term:
    """The last chunk's (rank 0's second: it reads all n keys) logits and their softmax's gradient, and beside them
    the causal mask's rows of that chunk (model/mixers.py `_materialized`: kernels.causal_mask(t1, first_row=t0),
    rows × n · a)."""
    mixer = shape_model(cfg).blocks[index].mixer
    mask = 0
    if isinstance(mixer, SynthesizedAttention):
        Hl = mixer.value.weight.shape[0] // mixer.d_h // tp
        batch = B if cfg.document_mask or any(synth.input_dependent for synth in mixer.synth.values()) else 1
        mask = 0 if cfg.document_mask else a * spans(n, cp)[0] * n
    else:
        Hl, batch = mixer.spatial.shape[0] // tp, B
    return Term(f"layer {index}: the last chunk's logits and their gradient{', its causal mask rows' * bool(mask)}",
                2 * a * batch * Hl * spans(n, cp)[0] * n + mask)


def cp_activations(cfg: ModelConfig, B: int, n: int, cp: int, tp: int = 1, a: int = 4, checkpoint_every: int = 0,
                   layers: range | None = None, first: bool = True, last: bool = True, pipeline: bool = False,
                   gpu: bool = False, sp: int = 1) -> Activations:
    """model/memory.py's `activations` under cp: the embedding and the head at n/cp positions, each block's terms
    above (`checkpoint_every` k > 0: blocks 0, k, 2k, … keep their input, n/cp positions (n/(cp·sp) under sequence
    parallelism), and the whole window's gathered rows B·n·F that the chunks' recomputation reads, pipeline stages
    excepted, and come back one at a time in backward)."""
    s, P, K = spans(n, cp)
    layers = range(cfg.n_layers) if layers is None else layers
    outer = activations(cfg, B, P, tp, a, 0, range(0), first, last, pipeline, gpu, sp)   # embedding, head, docs
    kept, worst = list(outer.kept), outer.transient
    mixers, groups = cfg.layer_mixers(), {}
    for i in layers:
        size = sum(t.bytes for t in layer_terms(cfg, i, B, n, cp, tp, a, gpu, sp))
        if checkpoint_every and i % checkpoint_every == 0:   # and, unless a pipeline stage recomputes both chunks
            # in one region, the ContextCache that each chunk's recomputation takes along: every chunk's rows, B·n·F
            cache = 0 if pipeline else a * B * n * gathered_width(cfg, i, tp)
            what = f"{mixers[i]}, checkpointed: its input{'' if pipeline else ' and its gathered rows'}"
            each = a * B * P * cfg.d_model // sp + cache
            if size > worst.bytes:
                worst = Term(f"layer {i} ({mixers[i]}) recomputed in backward", size)
        else:
            what, each = mixers[i], size
            step = transient(cfg, i, B, n, cp, tp, a)
            worst = step if step.bytes > worst.bytes else worst
        count, _ = groups.get(what, (0, each))
        groups[what] = (count + 1, each)
    kept += [Term(f"{count} layer(s) ({what}) under cp {cp}", count * each) for what, (count, each) in groups.items()]
    return Activations(kept, worst)
