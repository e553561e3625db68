"""The lengths the data stages train at (data.seq_len, data.stages[i].seq_len) against the model and the layout. A stage
of L trains each sample of model.max_seq_len = M as M/L rows of L (tokendata/lengths.py `StageLengths`): L must divide
M, is at most M (the model's position-indexed weights hold M positions: a longer stage needs a longer model first),
and splits as the layout splits a sequence (`split_problem`, which model.max_seq_len passes too). A step keeps its
tokens, so the LR schedule, train.max_tokens and the time and memory plans (made at M, the largest) stand."""
from __future__ import annotations

from model.config import ConfigError
from tokendata.sources import stage_lengths


def length_list(data) -> list[tuple[int, int]]:
    """[(first step, L)] of the stages that set a length (TokenStream's stage_lengths)."""
    return [(step, L) for _, step, L in stage_lengths(data.stages, data.seq_len)]


def split_problem(key: str, n: int, parallel) -> str | None:
    """Why a sequence of n positions (`key`: model.max_seq_len or a stage's length) does not split as the layout
    splits it, in one line, or None: context parallelism cuts it into 2·cp chunks; sequence parallelism cuts it, or
    under cp each chunk, into tp parts."""
    cp, tp = parallel.cp, parallel.tp
    if cp > 1 and n % (2 * cp):
        return (f"{key}={n} is not divisible by 2·parallel.cp = {2 * cp}, as context parallelism needs (each rank "
                "holds two chunks of n/(2·cp)); choose a multiple of it")
    split, by = (2 * cp * tp, f"2·parallel.cp·parallel.tp = {2 * cp * tp}") if cp > 1 else (tp, f"parallel.tp={tp}")
    if tp > 1 and parallel.sequence_parallel and n % split:
        return (f"{key}={n} is not divisible by {by}, as parallel.sequence_parallel needs (each TP rank holds "
                f"n/{split} positions); choose a multiple of {split} or set parallel.sequence_parallel=false")
    return None


def check_stage_lengths(model, parallel, data) -> None:
    """A one-line ConfigError naming the key of a stage length the model or the layout cannot train."""
    M = model.max_seq_len
    for key, _, L in stage_lengths(data.stages, data.seq_len):
        if L > M:
            raise ConfigError(f"{key}={L} exceeds model.max_seq_len={M}: the model's position-indexed weights hold "
                              f"{M} positions; grow the model first (tools/convert.py extend-length --to {L}, or "
                              f"checkpoint.extend_length=true with model.max_seq_len={L}), or set {key} ≤ {M}")
        if M % L:
            raise ConfigError(f"{key}={L} does not divide model.max_seq_len={M}: a stage cuts each sample of {M} "
                              f"tokens into rows of {key}; choose a divisor of {M}")
        if problem := split_problem(key, L, parallel):
            raise ConfigError(problem)
        if parallel.pp > 1 and L != M:
            raise ConfigError(f"{key}={L} needs parallel.pp=1: the pipeline engine sends activations of one shape "
                              f"(model.max_seq_len={M} positions) between its stages; set {key}={M} or parallel.pp=1")
