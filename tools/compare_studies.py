#!/usr/bin/env python
"""Two variant studies side by side (tools/ablate.py's results.json each): the perplexities, ranks and verdicts of
both, the pairs whose order changed and by how much, and how far each study's order is from the paper's.

    python tools/compare_studies.py docs/study/cpu-600.json docs/study/cpu-600-documents.json \\
        --names windows,documents

Prints markdown. A pair's gap is (ppl of the worse − ppl of the better) ÷ ppl of the better, in the first study's
order (negative in the second where the order flipped). Agreement with the paper (Tay et al. 2020, LM1B) is Kendall's τ
over the variants that have a paper figure: +1 the paper's order, −1 its reverse.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

from tools.ablate import PAPER_LM1B, ranking, spread


def perplexities(path: str) -> dict[str, list[float]]:
    with open(path) as f:
        runs = json.load(f)["runs"]
    return {v: [r["val_ppl"] for r in rows] for v, rows in runs.items()}


def kendall_tau(order: list[str], reference: dict[str, float]) -> float:
    """τ between the order of `order` (best first) and the reference's ascending values, over their common names."""
    common = [v for v in order if v in reference]
    pairs = list(itertools.combinations(common, 2))
    agree = sum(1 if reference[a] < reference[b] else -1 for a, b in pairs)
    return agree / len(pairs) if pairs else float("nan")


def compare(a: dict[str, list[float]], b: dict[str, list[float]], names: tuple[str, str]) -> str:
    variants = [v for v in a if v in b]
    mean = {k: {v: spread(ppl[v])[0] for v in variants} for k, ppl in zip(names, (a, b))}
    order = {k: sorted(variants, key=mean[k].get) for k in names}
    rank = {k: {v: order[k].index(v) + 1 for v in variants} for k in names}
    verdict = {k: {(x, y): ranked for x, y, ranked in ranking({v: ppl[v] for v in variants})}
               for k, ppl in zip(names, (a, b))}

    def cell(values):
        m, lo, hi = spread(values)
        return f"{m:.2f} [{lo:.2f}, {hi:.2f}]" if len(values) > 1 else f"{m:.2f}"

    n0, n1 = names
    lines = [f"| variant | val ppl, {n0} | rank | val ppl, {n1} | rank | change | paper, LM1B ppl (rank) |",
             "|---|---|---|---|---|---|---|"]
    paper_rank = {v: i + 1 for i, v in enumerate(sorted((v for v in variants if v in PAPER_LM1B), key=PAPER_LM1B.get))}
    for v in order[n0]:
        change = (mean[n1][v] - mean[n0][v]) / mean[n0][v]
        paper = f"{PAPER_LM1B[v]} ({paper_rank[v]})" if v in PAPER_LM1B else "—"
        lines.append(f"| {v} | {cell(a[v])} | {rank[n0][v]} | {cell(b[v])} | {rank[n1][v]} | {change:+.1%} | {paper} |")
    lines += ["", "Verdicts (A < B: A's worst seed beats B's best; ≈: the seeds cannot tell them apart):", "",
              f"| pair | {n0} | gap | {n1} | gap |", "|---|---|---|---|---|"]
    for x, y in itertools.combinations(order[n0], 2):
        cells = []
        for k in names:
            ranked = verdict[k].get((x, y), verdict[k].get((y, x)))
            first = x if mean[k][x] <= mean[k][y] else y
            second = y if first == x else x
            cells += [f"{first} {'<' if ranked else '≈'} {second}", f"{(mean[k][y] - mean[k][x]) / mean[k][x]:+.1%}"]
        flipped = (mean[n0][x] <= mean[n0][y]) != (mean[n1][x] <= mean[n1][y])
        lines.append(f"| {x}, {y}{' (order changed)' if flipped else ''} | " + " | ".join(cells) + " |")
    taus = {k: kendall_tau(order[k], PAPER_LM1B) for k in names}
    lines += ["", "Order, best first: " + "; ".join(f"{k}: {' < '.join(order[k])}" for k in names) + ". Paper (LM1B): "
              + " < ".join(sorted((v for v in variants if v in PAPER_LM1B), key=PAPER_LM1B.get)) + ".",
              "Kendall's τ with the paper's order over the variants it has: "
              + ", ".join(f"{k} {taus[k]:+.2f}" for k in names) + "."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("first", help="results.json of the first study")
    p.add_argument("second", help="results.json of the second study")
    p.add_argument("--names", default="first,second", help="what to call the two studies (comma-separated)")
    args = p.parse_args(argv)
    names = tuple(args.names.split(","))
    if len(names) != 2:
        print(f"error: --names={args.names!r} must be two names separated by a comma", file=sys.stderr)
        return 2
    try:
        print(compare(perplexities(args.first), perplexities(args.second), names))
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot read a study's results.json: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
