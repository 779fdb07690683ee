"""A kvsim policy's counterpart in NVIDIA kvpress: the press whose kept sets equal the policy's.

kvpress compresses a prompt once, after its prefill: a press scores the prompt's tokens per (layer, KV head) and
keeps ``int(P * (1 - compression_ratio))`` of them (``kvpress.utils.compute_n_kept``'s rule). A kvsim policy
that selects its prompt the same way at ``budget`` slots per head has a counterpart there: each policy class
declares it in ``Policy.kvpress_press`` (next to the rule it mirrors), and three readers use that one declaration:
``kvsim export --kvpress`` (the Python that builds it), ``kvsim recommend`` (printed beside its answer) and
``benchmarks/kvpress_parity.py`` (which builds the declared press inside kvpress and compares kept sets).

What a declaration promises is about the *prompt*: kvpress's press (unless it is a ``DecodingPress``) keeps every
token generated after it, while kvsim's policy holds its budget at every decode step. A policy whose rule differs
from every press (H2O's streamed scores, Ada-KV's safeguard, PyramidKV's layer budgets) raises `NoKvpressPress`
saying why; one that differs only by a few protected tokens (kvsim keeps the newest token, a press keeps none)
declares how many tokens per head may differ (``differs_by``), and the export refuses a budget at which that
could bring the Jaccard index of the kept sets below 0.99.

This module imports nothing from kvpress: a press is data (``{"cls": "SnapKVPress", "window_size": 64}``, an
inner press as a nested dict), turned into Python text here and into objects only inside kvpress's environment.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any

from policies.core.errors import PolicyError

#: the least Jaccard index of kept sets an export may promise (the parity benchmark's bar)
MIN_JACCARD = 0.99


class NoKvpressPress(PolicyError):
    """The policy (with these parameters) has no kvpress press that keeps the same sets; the message says why."""


@dataclass(frozen=True)
class KvpressPress:
    """A kvpress press spec and what holds for it.

    press: ``{"cls": NAME, **kwargs}``; a dict value with "cls" is an inner press. sets_ratio: the press's size
    is its ``compression_ratio`` (False: it decides its own sizes, DuoAttention's head split, DMS's threshold, and
    kvsim is compared at a budget of the whole prompt). budgets: how kvsim's budget maps to kvpress's count --
    "uniform" (every head keeps ``budget``), "prompt" (the press decides). unit: tokens per unit of kvpress's count
    (ChunkKV keeps whole chunks of ``chunk_length``). differs_by: at most this many tokens per head may differ
    (``differs_why`` says which: by default tokens kvsim protects and the press does not). attn: the attention implementation kvpress's model needs
    ("eager" when the press reads attention weights). needs: what the press loads from the Hugging Face hub that
    kvsim computes itself (the parity benchmark hands kvsim's values to it). note: anything else a user must know.
    """

    press: dict[str, Any]
    sets_ratio: bool = True
    budgets: str = "uniform"
    unit: int = 1
    differs_by: int = 0
    differs_why: str = "tokens kvsim protects and the press does not"
    attn: str = "sdpa"
    needs: tuple[str, ...] = ()
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def require(policy: Any, press: str, **wanted: Any) -> None:
    """Raise `NoKvpressPress` unless ``policy.params`` has every value of ``wanted`` (kvpress's rule in kvsim's
    parameters), naming each that differs and the spec that would match."""
    bad = {k: v for k, v in wanted.items() if policy.params[k] != v}
    if bad:
        have = ", ".join(f"{k}={policy.params[k]}" for k in bad)
        need = ",".join(f"{k}={_spec_value(v)}" for k, v in bad.items())
        raise NoKvpressPress(f"{policy.name}: kvpress's {press} has another rule than {have}; "
                             f"{policy.name}:{need} keeps its sets")


def protected_extra(policy: Any, n_sink: int = 0, sink_param: str | None = "n_sink",
                    recent_param: str | None = "n_recent") -> int:
    """Tokens per head that kvsim protects beyond what the press protects (its ``n_sink`` sinks): the press may
    evict them, so at most that many of a head's kept tokens differ."""
    extra = 0
    if sink_param is not None:
        extra += max(0, int(policy.params[sink_param]) - n_sink)
    if recent_param is not None:
        extra += int(policy.params[recent_param])
    return extra


def _spec_value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def n_kept(k_len: int, ratio: float) -> int:
    """kvpress's count of kept tokens at a compression ratio (``kvpress.utils.compute_n_kept``'s rule)."""
    return 0 if ratio >= 1.0 else max(1, int(k_len * (1 - ratio)))


def compression_ratio(kept: int, total: int) -> float:
    """The shortest decimal ratio at which kvpress keeps exactly ``kept`` of ``total`` units (0.0: all)."""
    if kept >= total:
        return 0.0
    if kept < 1:
        raise ValueError(f"kvpress keeps at least one token; {kept} of {total} asked")
    exact = (total - kept) / total
    for digits in range(1, 10):
        r = round(exact, digits)
        if 0.0 <= r < 1.0 and n_kept(total, r) == kept:
            return r
    return (total - kept - 0.5) / total        # int(total * (1 - r)) = kept, whatever the rounding


def press_repr(spec: dict[str, Any]) -> str:
    """``AdaKVPress(press=SnapKVPress(window_size=64), alpha_safeguard=0.2)`` of a press spec."""
    args = ", ".join(f"{k}={press_repr(v) if isinstance(v, dict) and 'cls' in v else repr(v)}"
                     for k, v in spec.items() if k != "cls")
    return f"{spec['cls']}({args})"


def press_classes(spec: dict[str, Any]) -> list[str]:
    """Every press class a spec builds, outermost first."""
    out = [spec["cls"]]
    for v in spec.values():
        if isinstance(v, dict) and "cls" in v:
            out += press_classes(v)
    return out


@dataclass(frozen=True)
class Export:
    """What ``kvsim export --kvpress`` prints: the press, its compression ratio and the promise."""

    spec: str
    counterpart: KvpressPress
    budget: int
    prompt_tokens: int
    ratio: float | None             # None: the press decides its own sizes
    kept_per_head: int | None       # kvpress's count at that ratio
    jaccard_floor: float            # the least Jaccard index the promise allows (1.0: identical sets)

    def python(self) -> str:
        """Python that builds the press (run it where kvpress is installed)."""
        spec = self.counterpart.press
        names = sorted(set(press_classes(spec)))
        c = self.counterpart
        same = ("the same kept sets" if self.jaccard_floor == 1.0 else
                f"kept sets with a Jaccard index >= {self.jaccard_floor:.3f} ({c.differs_why})")
        lines = [f"from kvpress import {', '.join(names)}", "",
                 f"# kvsim {self.spec} at {self.budget} slots per KV head, prompt of {self.prompt_tokens} tokens: {same}",
                 *(f"# {line}" for line in textwrap.wrap(c.note, 110)),
                 *([f"# attn_implementation='{c.attn}': the press reads the attention weights"] if c.attn != "sdpa"
                   else []),
                 f"press = {press_repr(spec)}"]
        if self.ratio is not None:
            unit = self.counterpart.unit
            count = (f"int({self.prompt_tokens} * (1 - {self.ratio!r})) = {self.kept_per_head} tokens"
                     if unit == 1 else f"{self.kept_per_head} chunks of {unit} tokens")
            lines.append(f"press.compression_ratio = {self.ratio!r}   # keeps {count} per KV head")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        c = self.counterpart
        return {"spec": self.spec, "press": c.press, "press_repr": press_repr(c.press), "compression_ratio": self.ratio,
                "kept_per_head": self.kept_per_head, "budget": self.budget, "prompt_tokens": self.prompt_tokens,
                "differs_by": c.differs_by, "jaccard_floor": self.jaccard_floor, "attn_implementation": c.attn,
                "needs": list(c.needs), "note": c.note, "python": self.python()}


def export(policy: Any, budget: int, prompt_tokens: int, spec: str | None = None) -> Export:
    """The press for ``policy`` at ``budget`` slots per KV head on a prompt of ``prompt_tokens`` tokens, or
    `NoKvpressPress` saying why there is none (the policy's own declaration, or a budget at which kvsim's extra
    protected tokens could bring the kept sets' Jaccard index below `MIN_JACCARD`)."""
    spec = spec or policy.label()
    if budget < 1 or prompt_tokens < 1:
        raise NoKvpressPress(f"budget and prompt tokens must be >= 1, got {budget} and {prompt_tokens}")
    if policy.unbounded:
        raise NoKvpressPress(f"{spec} keeps everything: run the model without a press (kvpress's default)")
    c = policy.kvpress_press()
    if not c.sets_ratio:
        ratio, kept, floor = None, None, 1.0
    else:
        total = -(-prompt_tokens // c.unit)
        kept_units = min(budget // c.unit, total) if c.unit > 1 else min(budget, prompt_tokens)
        if kept_units < 1:
            raise NoKvpressPress(f"{spec}: a budget of {budget} holds no whole unit of {c.unit} tokens")
        ratio, kept = compression_ratio(kept_units, total), kept_units
        held = min(budget, prompt_tokens)
        partial = 0
        if c.unit > 1 and budget < prompt_tokens:   # kvsim fills a part-chunk; kvpress may keep the prompt's short one
            partial = budget % c.unit + ((c.unit - prompt_tokens % c.unit) if prompt_tokens % c.unit else 0)
        diff = c.differs_by + partial
        floor = 1.0 if diff == 0 or budget >= prompt_tokens else max(0.0, held - diff) / (held + diff)
        if floor < MIN_JACCARD:
            why = "; ".join(w for w in (c.differs_why if c.differs_by else "",
                                        f"{partial} of a part-chunk" if partial else "") if w)
            raise NoKvpressPress(
                f"{spec} at {budget} slots: up to {diff} tokens per head may differ from {press_repr(c.press)} "
                f"({why}), a Jaccard index down to {floor:.3f} < {MIN_JACCARD}; a larger budget"
                + (" or no protected tokens (n_sink / n_recent as the press)"
                   if c.differs_by and c.differs_why == KvpressPress.differs_why else "")
                + " keeps it above")
    return Export(spec, c, int(budget), int(prompt_tokens), ratio, kept, floor)


def export_holds(floor: float, measured: float) -> bool:
    """Whether a measured Jaccard index of the kept sets keeps an export's promise (``Export.jaccard_floor``): the bar
    `MIN_JACCARD` (an export never promises less), not the floor itself, since equal scores at the cut are kept in
    an order neither side specifies (torch.topk; kvpress's float32 scores against kvsim's float64), which can cost
    a token on top of the floor's protected ones."""
    return bool(min(floor, measured) >= MIN_JACCARD - 1e-12)


def export_summary(policy: Any, budget: int, prompt_tokens: int, spec: str | None = None) -> dict[str, Any]:
    """`export`'s JSON, or ``{"refused": why}``: what a recommendation shows beside its ``kvsim generate`` line."""
    try:
        return export(policy, budget, prompt_tokens, spec).to_json()
    except NoKvpressPress as e:
        return {"spec": spec or policy.label(), "refused": str(e)}


def summary_line(summary: dict[str, Any]) -> str:
    """One line for a terminal or a page: the press and its ratio, or why there is none."""
    if "refused" in summary:
        return f"No kvpress press keeps the same tokens: {summary['refused']}"
    ratio = "" if summary["compression_ratio"] is None else f", compression_ratio={summary['compression_ratio']!r}"
    same = ("the same kept prompt tokens" if summary["jaccard_floor"] == 1.0 else
            f"kept prompt tokens with Jaccard >= {summary['jaccard_floor']:.3f}")
    return f"In kvpress: {summary['press_repr']}{ratio} ({same}; kvsim export --kvpress for the code)"
