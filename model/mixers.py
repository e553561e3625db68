"""Token mixers: synthesized attention (one synthesizer or a mixture) and the gMLP spatial gating unit.

Legend: B batch, n length, d width, H heads, Hl = H/TP heads on this rank, d_h = d/H.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import documents, kernels, parallel as tp
from .config import ModelConfig
from .forms import FactorForm, MapForm, QKForm
from .qk_attention import biased_qk_attention, concat_features, qk_attention, with_key_bias
from .synthesizers import linear_flops, per_head
from .variants import build_synthesizer, parse_mixer


class SynthesizedAttention(nn.Module):
    """Y = concat_h(A_h V_h) W_o with A_h = softmax(Σ_m α_m^h S_m^h + M) and V_h = X W_v^h.

    S_m^h are the logits of the synthesizers named in `mixer` ('dense', 'random+dot', …); with several,
    α^h = softmax(θ^h), θ `theta` (Hl, m) learnable per head, initialised to 0 (equal weights).
    W_v: d → d column-parallel (heads split over TP), W_o: d → d row-parallel (partial sums all-reduced).
    `impl='fused'` runs the kernels of model/kernels.py; `impl='reference'` materializes A and can return it, also
    for the rows of positions t0… of a sequence whose earlier positions are in a decoding `cache` (model/decoding.py).
    `docs` (model/documents.py, `model.document_mask`): M masks to the same document, and every member reads its
    position-indexed weights at the positions within the documents.
    """

    def __init__(self, cfg: ModelConfig, mixer: str, n_layers_scale: float):
        super().__init__()
        d, self.d_h, self.impl = cfg.d_model, cfg.head_dim, cfg.impl
        self.names = parse_mixer(mixer)
        self.value = tp.column_linear(d, d, cfg.bias, cfg.init_std)
        self.synth = nn.ModuleDict({name: build_synthesizer(name, cfg) for name in self.names})
        self.theta = per_head(cfg.n_heads, len(self.names), init=tp.constant(0.0)) if len(self.names) > 1 else None
        self.out = tp.row_linear(d, d, cfg.bias, cfg.init_std * n_layers_scale)
        self.dropout = cfg.mixer_dropout

    def _weights(self):
        """α (Hl, m) = softmax(θ) over the mixture's members, or None for a single synthesizer."""
        return None if self.theta is None else torch.softmax(self.theta, dim=-1)

    def forward(self, x: torch.Tensor, return_map: bool = False, t0: int = 0, cache=None, docs=None):
        B, m, _ = x.shape
        if self.impl == "reference" or return_map or cache is not None:
            v = self.value(x).view(B, m, -1, self.d_h)                   # (B, m, Hl, d_h)
            y, A = self._materialized(x, v, t0, cache, docs)             # (B, m, Hl, d_h)
        else:
            inputs = self._projected(x)
            v = inputs[self.value].view(B, m, -1, self.d_h)
            y, A = (self._fused(x, v, inputs) if docs is None else self._fused_documents(x, v, inputs, docs)), None
        if self.dropout and self.training:
            with tp.rng_tracker.fork(y.device):                          # heads differ per TP rank
                y = F.dropout(y, self.dropout)
        out = self.out(y.reshape(B, m, -1))                              # (B, m, d)
        return (out, A) if return_map else out

    def _projected(self, x):
        """{linear: linear(x)} for the values and every member's `projections()`. One synthesizer alone: one GEMM
        (parallel.joint_column), as its outputs all go whole into the attention kernel, which keeps them for backward
        anyway (dot's q, k, v). In a mixture each apart: a slice of a joint output would keep the whole of it alive
        where the kernel keeps only a concatenation made from it."""
        layers = [self.value] + [layer for synth in self.synth.values() for layer in synth.projections()]
        outputs = tp.joint_column(x, layers) if len(self.synth) == 1 else [layer(x) for layer in layers]
        return dict(zip(layers, outputs))

    def _materialized(self, x, v, t0=0, cache=None, docs=None):
        """Rows i = t0 … t1−1 of S = Σ α_m S_m (B, Hl, m, t1), A = softmax(S + M), Y_h = A_h V_h over keys j < t1;
        a cache holds the values (and dot keys) of positions < t0 and takes those of x's. Documents: M causal ∧ same
        document, each member's logits at the positions in the documents."""
        t1 = t0 + x.shape[1]
        v = v.transpose(1, 2)                                            # (B, Hl, m, d_h)
        if cache is not None:
            v = cache.extend("v", v, t0)                                 # (B, Hl, t1, d_h)
        alpha, S, p = self._weights(), 0, None if docs is None else docs.positions   # p (B, t1)
        for k, (name, synth) in enumerate(self.synth.items()):
            if cache is not None and synth.cached:   # (a member that knows no documents is called as before)
                keys = cache.extend(name, synth.keys(x, t0) if p is None else synth.keys(x, t0, p), t0)
            else:
                keys = None
            S_k = synth.logits(x, t0, keys) if p is None else synth.logits(x, t0, keys, p)   # (B or 1, Hl, m, t1)
            S = S + (S_k if alpha is None else alpha[:, k, None, None] * S_k)
        if docs is None:
            S = S + kernels.causal_mask(t1, x.device, S.dtype, t0)       # rows i: keys j ≤ i
        else:
            S = S.masked_fill(~docs.dense_mask(t0), float("-inf"))       # keys j ≤ i of i's document
        A = torch.softmax(S, dim=-1).expand(x.shape[0], -1, -1, -1)
        return (A @ v).transpose(1, 2), A                                # (B, m, Hl, d_h), (B, Hl, m, t1)

    def _fused(self, x, v, inputs):
        """Each member's logits in its fused form (model/forms.py), grouped by form: q·k features in one group per
        member (scaled by α; concatenated where a kernel takes one q and k), a shared map weighted by α, factors on
        their own kernel (never mixed)."""
        alpha = self._weights()
        forms = [synth.fused(x, inputs) for synth in self.synth.values()]
        if isinstance(forms[0], FactorForm):   # factorized dense: its own kernel
            return kernels.factorized_dense_attention(forms[0].A, forms[0].B, v.transpose(1, 2)).transpose(1, 2)
        qs, ks, scale, bias, bias_weight, key_bias = [], [], 1.0, None, None, None
        input_dependent = any(synth.input_dependent for synth in self.synth.values())
        for m, form in enumerate(forms):
            w = None if alpha is None else alpha[:, m]                    # (Hl,)
            if isinstance(form, QKForm):                                 # q, k (B or 1, Hl, n, f)
                if w is None:
                    q, scale = form.q, form.scale
                else:   # α·s·(q·k) = (α·s·q)·k: fold the weight into the query features (in q's dtype)
                    q = form.q * (w * form.scale).to(form.q.dtype)[:, None, None]
                qs.append(q)
                ks.append(form.k)
                if form.key_bias is not None:                            # b_j (Hl, n), weighted α·b_j in a mixture
                    key_bias = form.key_bias if w is None else w[:, None] * form.key_bias
            elif isinstance(form, MapForm):
                bias, bias_weight = form.S, w                            # (Hl, n, n), (Hl,) or None
            else:
                raise TypeError(f"{type(form).__name__} of '{self.names[m]}' cannot be a member of a mixture")
        if not input_dependent:   # the map is the same for every sample: one map, the batch in V's columns
            S = bias                                                     # (Hl, n, n) or None
            if bias is not None and bias_weight is not None:   # α ⊙ R, in autocast's dtype where it is on
                bias, bias_weight = kernels.at_autocast_dtype(bias, bias_weight)
                S = bias_weight[:, None, None] * bias
            q = k = None
            if qs:   # factors (Hl, n, Σf), the scale folded into q
                q, k = torch.cat([p[0] for p in qs], -1), torch.cat([p[0] for p in ks], -1)
                q = q if scale == 1.0 else q * scale
            return kernels.shared_map_attention(S, v, q, k)
        # under autocast, fp32 parameters among the features (dense's W_2 rows, R_1/R_2) are cast while Hl·n·f,
        # not as the (B, Hl, n, Σf) concatenation that SDPA would cast again
        qs, ks = kernels.at_autocast_dtype(*qs), kernels.at_autocast_dtype(*ks)
        v = v.transpose(1, 2)                                            # (B, Hl, n, d_h)
        if bias is None:   # the groups (B or 1, Hl, n, f_m), concatenated only where the kernel needs it
            y = qk_attention(list(qs), list(ks), v, scale, key_bias)
        else:   # in a mixture: weight α, no n² copy; scale 1 (folded into q)
            q, k = concat_features(qs), concat_features(ks)              # (B or 1, Hl, n, Σf)
            y = biased_qk_attention(*with_key_bias(q, k, key_bias, 1.0), bias, bias_weight, v)
        return y.transpose(1, 2)                                         # (B, n, Hl, d_h)

    def _fused_documents(self, x, v, inputs, docs):
        """Under the document mask: every member's form at the positions in the documents (per sample), one masked
        call of model/documents.py `attention` (q·k features concatenated, α folded into q; the map weighted by α)."""
        alpha, p = self._weights(), docs.positions
        terms, qs, ks, scale = {}, [], [], 1.0
        for m, form in enumerate(synth.fused(x, inputs, p) for synth in self.synth.values()):
            w = None if alpha is None else alpha[:, m]                    # (Hl,)
            if isinstance(form, QKForm):
                qs.append(form.q if w is None else form.q * (w * form.scale).to(form.q.dtype)[:, None, None])
                ks.append(form.k)
                scale = form.scale if w is None else 1.0
                if form.key_bias is not None:                            # (B, Hl, n), weighted α·b_j in a mixture
                    terms["key_bias"] = form.key_bias if w is None else w[:, None] * form.key_bias
            elif isinstance(form, MapForm):
                terms.update(R=form.S, w=w)
            else:
                terms["factors"] = (form.A, form.B)
        q = k = None
        if qs:
            qs, ks = kernels.at_autocast_dtype(*qs), kernels.at_autocast_dtype(*ks)
            q, k = concat_features(qs), concat_features(ks)              # (B or 1, Hl, n, Σf)
        y = documents.attention(v.transpose(1, 2), docs, q, k, scale, **terms)   # (B, Hl, n, d_h)
        return y.transpose(1, 2)                                         # (B, n, Hl, d_h)

    # ---- accounting --------------------------------------------------------------------------------
    def synthesizer_parameters(self):
        """(name, param) of the synthesizing function: Table 1 counts these, without V/O and biases."""
        for name, p in self.synth.named_parameters():
            if not name.endswith("bias"):
                yield f"synth.{name}", p
        if self.theta is not None:
            yield "theta", self.theta

    def flops(self, n):
        """Forward FLOPs per token."""
        H = tp.full_shape(self.value.weight)[0] // self.d_h
        mixing = 2 * n * H * self.d_h + (len(self.names) - 1) * H * n     # A V, plus the α-weighted sum
        return (linear_flops(self.value) + linear_flops(self.out) + mixing
                + sum(s.flops(n) for s in self.synth.values()))

    def train_flops(self, n):
        """Forward + backward (2 × forward) per token; a map with nothing to learn needs no dA = dY Vᵀ."""
        frozen_map = not any(p.requires_grad for _, p in self.synthesizer_parameters()) and \
            not any(s.input_dependent for s in self.synth.values())
        return 3 * self.flops(n) - (2 * n * tp.full_shape(self.value.weight)[0] if frozen_map else 0)


class SpatialGatingMixer(nn.Module):
    """gMLP's spatial gating unit (Liu et al. 2021), causal and multi-head, as a token mixer.

    Z = GELU(X U) (B, n, 2·d_in) split per head group into Z1, Z2 (B, n, H, c), c = d_in/H;
    s(Z)_h = Z1_h ⊙ ((W^h ⊙ causal)[:n, :n] · LN(Z2_h) + b^h[:n]);  Y = s(Z) V.
    `spatial` W (Hl, L, L) ~ U(−ε/L, ε/L) and `spatial_bias` b (Hl, L) = 1, so the unit starts near identity
    gating; LN normalises each head group's channels (`norm_weight`, `norm_bias` (Hl, c)), which keeps every
    head's computation on the rank that owns it. U: d → 2·d_in column-parallel, laid out per head as
    (H, 2, c); V: d_in → d row-parallel. No softmax. Table 1: H·L² (+ H·L biases).
    """

    def __init__(self, cfg: ModelConfig, d_inner: int, n_layers_scale: float):
        super().__init__()
        d, L, H = cfg.d_model, cfg.max_seq_len, cfg.n_heads
        self.c, self.impl, self.eps = d_inner // H, cfg.impl, cfg.norm_eps
        self.in_proj = tp.column_linear(d, 2 * d_inner, cfg.bias, cfg.init_std)
        self.spatial = per_head(H, L, L, init=tp.uniform(cfg.sgu_init_eps / L))
        self.spatial_bias = per_head(H, L, init=tp.constant(1.0))
        self.norm_weight = per_head(H, self.c, init=tp.constant(1.0))
        self.norm_bias = per_head(H, self.c, init=tp.constant(0.0))
        self.out = tp.row_linear(d_inner, d, cfg.bias, cfg.init_std * n_layers_scale)

    def forward(self, x: torch.Tensor, return_map: bool = False, t0: int = 0, cache=None, docs=None):
        """Positions t0 … t1−1 (x: (B, m, d)); a decoding cache holds LN(Z2) of the positions before t0. Under the
        document mask (`docs`) the map of sample b is W[p_i, p_j] masked to i's document, b[p_i] its bias: made
        whole per sample, (B, Hl, m, t1), on every device (no softmax, so no attention kernel takes it)."""
        B, m, _ = x.shape
        t1 = t0 + m
        z = F.gelu(self.in_proj(x)).view(B, m, -1, 2, self.c)           # (B, m, Hl, 2, c)
        z1, z2 = z.unbind(-2)                                            # (B, m, Hl, c) each
        z2 = F.layer_norm(z2, (self.c,), eps=self.eps) * self.norm_weight + self.norm_bias
        if self.impl == "reference" or return_map or cache is not None or docs is not None:
            z2 = z2.transpose(1, 2)                                      # (B, Hl, m, c)
            if cache is not None:
                z2 = cache.extend("z2", z2, t0)                          # (B, Hl, t1, c)
            if docs is None:
                W = self.spatial[:, t0:t1, :t1].tril(t0)                 # (Hl, m, t1): W ⊙ causal, rows i ≥ j
            else:                                                        # (B, Hl, m, t1): W[p_i, p_j] ⊙ M
                p = docs.positions
                W = torch.where(docs.dense_mask(t0), documents.gathered_map(self.spatial, p[:, t0:], p), 0.0)
            gate = (W @ z2).transpose(1, 2)                              # (B, m, Hl, c)
        else:   # one causal matmul per head with the batch folded into the columns (no per-sample copy of W)
            Hl = z2.shape[2]
            cols = z2.permute(2, 1, 0, 3).reshape(Hl, m, B * self.c)     # (Hl, m, B·c)
            gate = kernels.causal_matmul(self.spatial, cols)             # (Hl, m, B·c)
            gate = gate.view(Hl, m, B, self.c).permute(2, 1, 0, 3)       # (B, m, Hl, c)
        if docs is None:
            gate = gate + self.spatial_bias[:, t0:t1].T[None, :, :, None]    # + b^h[i]
        else:
            gate = gate + self.spatial_bias[:, docs.positions[:, t0:]].permute(1, 2, 0)[..., None]   # + b^h[p_i]
        out = self.out((z1 * gate).reshape(B, m, -1))                    # (B, m, d)
        return (out, W.expand(B, -1, -1, -1)) if return_map else out

    def synthesizer_parameters(self):
        yield "spatial", self.spatial

    def activations(self, B, n, gpu=False, documents=False):
        """Elements it keeps for backward, all heads (model/memory.py): on the GPU path the masked map (W ⊙ causal)
        per head, on the CPU path the gate half with the batch in its columns; under the document mask, on either,
        the masked map of each sample and the gate half per head."""
        d_in, H = self.norm_weight.numel() * tp.tp_world(), self.spatial.shape[0] * tp.tp_world()
        out = {"U X before and after GELU": 4 * B * n * d_in, "normed gate half, the gate, their product": 3 * B * n * d_in}
        if documents:
            return {**out, f"masked map W[p_i, p_j] ⊙ M per sample, B·H·n² = {B}·{H}·{n}²": B * H * n * n,
                    "normed gate half per head, contiguous": B * n * d_in}
        return {**out, **({f"masked map W ⊙ causal, H·n² = {H}·{n}²": H * n * n} if gpu else
                          {"gate half with the batch in its columns": B * n * d_in})}

    def flops(self, n):
        Hl_c = self.norm_weight.numel() * tp.tp_world()                  # d_in
        return linear_flops(self.in_proj) + linear_flops(self.out) + 2 * n * Hl_c

    def train_flops(self, n):
        return 3 * self.flops(n)
