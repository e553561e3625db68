"""The memory plan as text (pretrain/plan/memory.py's `Plan`): the rows of each pipeline stage's rank, the verdict
against a GPU's memory, and the layouts that fit."""
from __future__ import annotations

from pretrain.plan.verdict import verdict

GIB = 2**30


def gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:,.1f} MiB"


def table(p, budget: int | None = None, alternatives: list | None = None,
          largest: int | None = None) -> str:
    """The plan `p` (pretrain/plan/memory.py `Plan`) as the text the launch check and the run's log print;
    `alternatives`: [(Layout, peak)] of the layouts that fit `budget`."""
    lay = p.layout
    lines = [f"memory plan per rank: {lay}, micro-batch {p.micro_batch} × n {p.seq_len}, {p.precision}, "
             f"activation checkpointing {'every ' + str(p.checkpointing) + ' layer(s)' if p.checkpointing else 'off'}"
             f", {'a GPU' if p.device == 'cuda' else 'a CPU'}"]
    for s in p.stages:
        where = f"pipeline stage {s.stage} of {lay.pp}: " if lay.pp > 1 else ""
        lines.append(f"  {where}{s.params[0] / 1e6:.2f}M trainable + {s.params[1] / 1e6:.2f}M frozen parameters "
                     f"on this rank")
        rows = [("model states", s.states), ("DeepSpeed buffers", s.buffers + ([s.pipe] if s.pipe.bytes else []))]
        for title, terms in rows:
            lines.append(f"    {title:<44}{gib(sum(t.bytes for t in terms)):>14}")
            lines += [f"      {t.name:<42}{gib(t.bytes):>14}" for t in terms]
        act = s.activations
        times = f" × {s.in_flight} micro-batches in flight" if s.in_flight > 1 else ""
        lines.append(f"    {'activations' + times:<44}{gib(act.total * s.in_flight):>14}")
        lines += [f"      {t.name:<42}{gib(t.bytes):>14}" for t in act.kept if t.bytes]
        for mixer, terms in s.breakdown.items():
            lines.append(f"      one {mixer} layer:")
            lines += [f"        {t.name:<40}{gib(t.bytes):>14}" for t in terms if t.bytes]
        lines.append(f"      {'+ largest temporary: ' + act.transient.name:<42}{gib(act.transient.bytes):>14}")
        if s.backward_extra.bytes:
            lines.append(f"      {'+ ' + s.backward_extra.name:<42}{gib(s.backward_extra.bytes):>14}")
        lines.append(f"    {'optimizer step: ' + s.step.name:<44}{gib(s.step.bytes):>14}")
        if s.host.bytes and s.host_is_device:
            lines.append(f"    {'+ ' + s.host.name:<44}{gib(s.host.bytes):>14}")
        lines.append(f"    {'peak':<44}{gib(s.peak):>14}")
        if s.host.bytes and not s.host_is_device:
            lines.append(f"    {'host memory: ' + s.host.name:<44}{gib(s.host.bytes):>14}")
        lines += [f"    note: {note}" for note in s.notes]
    if budget is not None:
        lines.append(f"with {gib(budget)} per GPU: {verdict(p.peak, budget, lay).text}; largest micro-batch that "
                     f"fits: {largest if largest else 'none (not even 1)'}")
    if alternatives is not None:
        lines.append(f"layouts of {lay.world} ranks that fit {gib(budget)} with headroom (peak of the "
                     f"fullest rank):")
        lines += [f"  tp {a.tp}  {f'cp {a.cp}  ' if a.cp > 1 else ''}pp {a.pp}  dp {a.dp}  ZeRO-{a.zero}   "
                  f"{gib(peak):>12}" for a, peak in alternatives]
        if not alternatives:
            lines.append("  none: raise the world size, lower the micro-batch or turn on activation checkpointing")
    return "\n".join(lines)


