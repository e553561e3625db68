"""Growing a trained model's length: every position-indexed weight of a model of ℓ = max_seq_len positions resampled
to N > ℓ (`extend_length`), the rule per weight below (docs/DESIGN.md §1, "Growing the length").

New position p of N stands at old coordinate x(p) = p·ℓ/N (position interpolation: the new positions subdivide the
old ones, so every new position is inside the range the model was trained on); x is clamped to ℓ − 1, and a weight
at x is linear between its rows ⌊x⌋ and ⌊x⌋ + 1. Where N/ℓ = g is an integer, new position g·i is old position i
exactly: every rule below reproduces the old weight there, bit for bit.

    AXIS   a weight with one position axis (the learned position table P, Dense's W_2 rows and b_2, factorized random's
           R_1 and R_2, SGU's b): P'[p] = lerp(P, x(p)); so R_1' R_2'ᵀ at grid points is R_1 R_2ᵀ.
    MAP    an ℓ × ℓ causal map (random's R): bilinear in (x(i), x(j)), from a copy whose entries above the diagonal
           (never used, never trained) are the row's diagonal entry: an entry j ≤ i of the new map mixes only entries
           of the old one that the causal mask kept.
    SUM    SGU's W: as MAP, then × ℓ/N. W·LN(Z_2) sums over the keys j ≤ i with no softmax, and each old key becomes
           N/ℓ new ones: the scale keeps the sum's size (its init is already U(−ε/L, ε/L)). Random's R needs no
           scale: the softmax shares a key's weight among its copies.
    BLOCK  factorized dense's F_A (a rows) and b_A: key j = r + a·q is (A[r], B[q]); growing a to a' = a·N/ℓ (b
           fixed) puts new key r' + a'q at old coordinate r'·ℓ/N + a·q, the uniform map within each block of a keys,
           so F_A' = lerp(F_A) along its a axis (clamped at a − 1 inside a block: the outer product cannot mix two
           blocks). N must be a multiple of b.
RoPE and dot products have no position-indexed weight. Any other parameter whose shape depends on max_seq_len is an
error naming it (a new variant must add its rule here), as is an N that is not larger.
"""
from __future__ import annotations

import torch

from .accounting import shape_model
from .config import ConfigError, ModelConfig
from .mixers import SpatialGatingMixer
from .synthesizers import Dense, FactorizedDense, FactorizedRandom, Random

AXIS, MAP, SUM, BLOCK = "axis", "map", "sum", "block"
# (module class, its parameter) -> the rule; the dim of the position axis is the one after the heads (dim 1)
RULES = {(Dense, "w2"): AXIS, (Dense, "w2_bias"): AXIS, (Random, "R"): MAP,
         (FactorizedRandom, "R1"): AXIS, (FactorizedRandom, "R2"): AXIS,
         (FactorizedDense, "fa"): BLOCK, (FactorizedDense, "fa_bias"): BLOCK,
         (SpatialGatingMixer, "spatial"): SUM, (SpatialGatingMixer, "spatial_bias"): AXIS}
TOP = {"wpe.weight": (AXIS, 0)}   # the learned position table (L, d): positions on dim 0


def lerp(t: torch.Tensor, dim: int, new: int) -> torch.Tensor:
    """t resampled along `dim` from its length ℓ to `new`: row p at x = p·ℓ/new (exact integers where p·ℓ/new is
    one), linear between ⌊x⌋ and ⌊x⌋ + 1, clamped at ℓ − 1."""
    old = t.shape[dim]
    p = torch.arange(new, dtype=torch.int64)
    lo = torch.clamp(p * old // new, max=old - 1)
    hi = torch.clamp(lo + 1, max=old - 1)
    w = (((p * old) % new).to(torch.float64) / new).to(t.dtype)        # past ℓ − 1: hi = lo, so the row itself
    shape = [1] * t.dim()
    shape[dim] = new
    a, b = t.index_select(dim, lo), t.index_select(dim, hi)
    return a + (b - a) * w.view(shape)                                   # w = 0: a itself, bit for bit


def causal_fill(m: torch.Tensor) -> torch.Tensor:
    """(…, ℓ, ℓ) with each entry above the diagonal replaced by its row's diagonal entry."""
    ell = m.shape[-1]
    i = torch.arange(ell)
    cols = torch.minimum(i[None, :], i[:, None])                         # (ℓ, ℓ): min(j, i)
    return m.gather(-1, cols.expand(*m.shape[:-2], ell, ell))


def resample(rule: str, dim: int, t: torch.Tensor, ell: int, N: int) -> torch.Tensor:
    """One weight by its rule (the module docstring), computed in float32, returned in t's dtype."""
    x = t.float()
    if rule == AXIS:
        out = lerp(x, dim, N)
    elif rule == BLOCK:
        out = lerp(x, dim, x.shape[dim] * N // ell)
    else:
        out = lerp(lerp(causal_fill(x), -2, N), -1, N)                   # (H, N, N)
        out = out * (ell / N) if rule == SUM else out
    return out.to(t.dtype)


def position_weights(cfg: ModelConfig) -> dict[str, tuple[str, int]]:
    """Canonical name -> (rule, position dim) of every position-indexed weight of the model `cfg` describes."""
    out = dict(TOP) if cfg.position == "learned" else {}
    for prefix, module in shape_model(cfg).named_modules():
        for name, _ in module.named_parameters(recurse=False):
            rule = RULES.get((type(module), name))
            if rule:
                out[f"{prefix}.{name}"] = (rule, 1)
    return out


def extended_config(cfg: ModelConfig, N: int, uses_block: bool) -> ModelConfig:
    """The config at N positions: factorized dense (`uses_block`) keeps b and grows a (BLOCK); without it, a·b is
    N's default."""
    ell, a, b = cfg.max_seq_len, cfg.factorized_a, cfg.factorized_b
    if N <= ell:
        raise ConfigError(f"--to {N} must be larger than the model's max_seq_len={ell} (extend-length grows a model)")
    if uses_block and N % b:
        raise ConfigError(f"--to {N}: factorized_dense keeps model.factorized_b={b} and grows a (a·b = N), so N must "
                          f"be a multiple of {b}; try --to {N + (-N) % b}")
    fields = dict(cfg.to_dict(), max_seq_len=N, factorized_a=a * N // ell if uses_block else None,
                  factorized_b=b if uses_block else None)
    return ModelConfig.from_dict(fields, "--to")


def extend_length(cfg: ModelConfig, tensors: dict[str, torch.Tensor], N: int) -> tuple[ModelConfig, dict]:
    """(the config at N positions, the full tensors with every position-indexed weight resampled): a ConfigError
    where N is not larger, does not suit factorized dense, or a weight that depends on the length has no rule."""
    rules = position_weights(cfg)
    new_cfg = extended_config(cfg, N, any(rule == BLOCK for rule, _ in rules.values()))
    before = {name: tuple(p.shape) for name, p in shape_model(cfg).named_parameters()}
    after = {name: tuple(p.shape) for name, p in shape_model(new_cfg).named_parameters()}
    for name in before:
        if before[name] != after[name] and name not in rules:
            raise ConfigError(f"parameter '{name}' has shape {list(before[name])} at max_seq_len={cfg.max_seq_len} "
                              f"and {list(after[name])} at {N}, but model/extend.py has no rule for it")
    out = {name: resample(*rules[name], t, cfg.max_seq_len, N) if name in rules else t
           for name, t in tensors.items()}
    for name, t in out.items():
        if tuple(t.shape) != after[name]:   # a rule that does not give the new config's shape: a bug, said plainly
            raise ConfigError(f"parameter '{name}' resampled to {list(t.shape)}, the config at {N} needs "
                              f"{list(after[name])}")
    return new_cfg, out
