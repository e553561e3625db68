"""The variant registry: every token mixer a config may name is registered here, once, and everything that lists
variants reads it — the config's valid mixer names (model/config.py), the module that runs a name
(model/mixers.py), the tests' variant lists, the benchmark's, and configs/variants/ (written by
tools/variant_configs.py, checked by tests/unit/test_config.py).

A variant is either
    a synthesizer   a module that gives its heads' logits S (a `Synthesizer` of model/forms.py); it runs inside
                    SynthesizedAttention, alone or, when `mixable`, as a member of a mixture 'a+b' or 'a+b+c'
    a mixer         a token mixer of its own with no logits to mix (gMLP's spatial gating unit, `sgu`, built by
                    model/lm.py's Block), never in a mixture

Adding a synthesizer whose logits take one of the existing forms is its class and one `register(Variant(...))`
(docs/adding-a-variant.md). Lists of variants, in registration order:
    names()                 every registered mixer name; names(mixable=True), names(synthesizer=True|False)
    subset(name)            the named lists the tests and the benchmark use (SUBSETS)
    model_fields(label)     the model fields of a list entry: {"mixer": label}, or gMLP's block and mixer
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch.nn as nn

from .fields import ConfigError
from .synthesizers import Dense, DotProduct, FactorizedDense, FactorizedRandom, Random


@dataclass(frozen=True)
class Variant:
    """One registered mixer name. `synthesizer(cfg)` builds the synthesizer from the model config, or is None for a
    mixer of its own; `mixable`: it may be a member of a mixture; `formula`: its logits, for people."""
    name: str
    synthesizer: Callable[..., nn.Module] | None
    mixable: bool = False
    formula: str = ""


REGISTRY: dict[str, Variant] = {}
GMLP = "gmlp"   # a list entry, not a mixer: gMLP blocks (model.block=gmlp) whose mixer is sgu
MAX_MEMBERS = 3


def register(variant: Variant) -> Variant:
    """Add a variant under its name (a Python identifier, not yet taken); returns it."""
    if not variant.name.isidentifier() or variant.name == GMLP:
        raise ConfigError(f"variant name {variant.name!r} must be an identifier (no '+': that joins a mixture) "
                          f"other than {GMLP!r}")
    if variant.name in REGISTRY:
        raise ConfigError(f"variant {variant.name!r} is registered already; pick another name")
    REGISTRY[variant.name] = variant
    return variant


def unregister(name: str) -> None:
    """Remove a registered variant (a test's own, when the test is done)."""
    REGISTRY.pop(name)


def names(mixable: bool | None = None, synthesizer: bool | None = None) -> list[str]:
    """Registered mixer names in registration order, optionally only those that are (not) mixable, or (not)
    synthesizers."""
    return [v.name for v in REGISTRY.values() if (mixable is None or v.mixable == mixable)
            and (synthesizer is None or (v.synthesizer is not None) == synthesizer)]


def build_synthesizer(name: str, cfg) -> nn.Module:
    """The synthesizer registered as `name`, for the model config `cfg`."""
    return REGISTRY[name].synthesizer(cfg)


# ---- mixer names in a config ----------------------------------------------------------------------------------------
def valid_mixer_names() -> str:
    return (", ".join(names()) + f", or a mixture of 2-{MAX_MEMBERS} of " + "/".join(names(mixable=True)) +
            " joined by '+' (e.g. random+dot)")


def parse_mixer(name: str, key: str = "model.mixer") -> tuple[str, ...]:
    """'random+dot' -> ('random', 'dot'); raises ConfigError listing the valid names."""
    if not isinstance(name, str):
        raise ConfigError(f"{key}={name!r} is not a string; use one of: {valid_mixer_names()}")
    parts = tuple(p.strip() for p in name.split("+"))
    if len(parts) == 1 and parts[0] in REGISTRY:
        return parts
    mixable = names(mixable=True)
    if 2 <= len(parts) <= MAX_MEMBERS and all(p in mixable for p in parts) and len(set(parts)) == len(parts):
        return parts
    guess = difflib.get_close_matches(name, names() + list(PAPER_MIXTURES), n=1)
    hint = f" (did you mean '{guess[0]}'?)" if guess else ""
    raise ConfigError(f"{key}: unknown mixer '{name}'{hint}; valid: {valid_mixer_names()}")


# ---- the built-in variants (Tay et al. 2020; gMLP: Liu et al. 2021); their formulas: docs/DESIGN.md §1 -------------
register(Variant("dot", DotProduct, mixable=True, formula="S = q kᵀ / √d_h, q = X W_q, k = X W_k"))
register(Variant("dense", Dense, mixable=True, formula="S[i, :] = W_2 σ(W_1 X_i + b_1) + b_2"))
register(Variant("random", Random, mixable=True, formula="S = R, R ∈ ℝ^{L×L} trained"))
register(Variant("random_fixed", partial(Random, frozen=True), formula="S = R, R ∈ ℝ^{L×L} fixed at init"))
register(Variant("factorized_dense", FactorizedDense, formula="S_i[j] = A_i[j mod a] · B_i[⌊j/a⌋], A, B from X_i"))
register(Variant("factorized_random", FactorizedRandom, mixable=True,
                 formula="S = R_1 R_2ᵀ, R_1, R_2 ∈ ℝ^{L×k}"))
register(Variant("sgu", None, formula="s(Z) = Z_1 ⊙ ((W ⊙ causal) LN(Z_2) + b): gMLP's spatial gating, no softmax"))

# The paper's two mixtures (its Table 2: R+V and D+V): part of the study, beside every single variant.
PAPER_MIXTURES = ("random+dot", "dense+dot")
# Mixtures that together reach every combination of forms the fused path has (model/forms.py): a map beside q·k,
# two q·k members, a map beside a q·k member with a key bias, two input-independent members, three members of both
# batch shapes, a map beside two q·k members.
MIXTURES = PAPER_MIXTURES + ("random+dense", "random+factorized_random", "dot+dense+factorized_random",
                             "random+dot+dense")


def model_fields(label: str) -> dict:
    """The model-config fields of a list entry: {"mixer": label}, or for 'gmlp' gMLP's block and its mixer."""
    return {"block": "gmlp", "mixer": "sgu"} if label == GMLP else {"mixer": label}


SUBSETS: dict[str, Callable[[], list[str]]] = {
    # every registered mixer, gMLP, and the mixtures of every fused form: the model's own tests
    "all": lambda: names() + [GMLP] + list(MIXTURES),
    "mixers": names,
    "mixable": partial(names, mixable=True),
    "synthesizers": partial(names, synthesizer=True),
    # one model layer of each: the synthesizers, the paper's mixtures, the mixers of their own (conversion tests,
    # benchmarks/bench_mixer.py)
    "layers": lambda: names(synthesizer=True) + list(PAPER_MIXTURES) + names(synthesizer=False),
    # the study: configs/variants/ (one file each, tools/variant_configs.py), tools/ablate.py, the benchmark
    "study": lambda: SUBSETS["layers"]() + [GMLP],
}


def subset(name: str) -> list[str]:
    """The named list (SUBSETS) as the registry stands now."""
    if name not in SUBSETS:
        raise KeyError(f"no variant subset {name!r}; subsets: {', '.join(SUBSETS)}")
    return SUBSETS[name]()
