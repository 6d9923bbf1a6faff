"""Numbers and names as the report, the plots and the analysis' sentences write them."""

from __future__ import annotations

import math

MODE_NAMES = {"ddp": "DDP", "pp": "PP"}


def fmt(x, digits: int = 3) -> str:
    """Numbers for tables: — for missing, thousands separators for counts, 3 significant digits otherwise."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if not isinstance(x, float):
        return str(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e3:
        return f"{x:.{digits}g}"
    return f"{x:,.0f}" if 1e3 <= abs(x) < 1e6 else f"{x:.{digits - 1}e}"


def fmt_loss(x) -> str:
    """Losses and loss gaps in nats: three decimals (a 2 % tolerance on a loss of ~5 is ~0.1)."""
    if x is None or not math.isfinite(x) or abs(x) >= 1e4:
        return fmt(x)
    return f"{x:.3f}"


def fmt_signed(x, number=fmt) -> str:
    return "—" if x is None else ("+" if x >= 0 else "") + number(x)


def fmt_pct(x) -> str:
    return "—" if x is None else f"{100 * x:+.1f} %"


def ber_text(ber: float | None) -> str:
    """1e-05, 2.4e-04, 0, any (inf: no BER is too high). Text that is not a number (YAML reads '1e-6' as a
    string) passes through."""
    if ber is None:
        return "—"
    try:
        ber = float(ber)
    except (TypeError, ValueError):
        return str(ber)
    if math.isinf(ber):
        return "any"
    return "0" if ber == 0 else f"{ber:.1e}".replace(".0e", "e")


def fraction_ci_text(value: float | None, ci: tuple[float, float] | None) -> str:
    """0.36 [0.30, 0.42]."""
    if value is None:
        return "—"
    return fmt(float(value)) + (f" [{fmt(float(ci[0]))}, {fmt(float(ci[1]))}]" if ci else "")


def status_text(statuses: dict) -> str:
    """{'ok': 1, 'crashed': 1} -> '1 ok, 1 crashed'."""
    return ", ".join(f"{n} {s}" for s, n in statuses.items()) or "—"


def mode_name(mode: str) -> str:
    return MODE_NAMES.get(mode, str(mode))


def config_label(config: tuple, all_configs: list[tuple]) -> str:
    """'DDP', 'DDP tensor/keep' when the experiment has several scopes or checksum modes, 'DDP sanitize' when it
    has several recipes. config: (mode, scope, checksum[, recipe])."""
    mode, scope, checksum, recipe = (*config, None)[:4]
    label = mode_name(mode)
    if len({c[1:3] for c in all_configs}) > 1:
        label += f" {scope}/{checksum}"
    if len({c[3] for c in all_configs if len(c) > 3}) > 1:
        label += f" {recipe}"
    return label


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines: header, rule, one line per row."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |"
                                                                            for r in rows]
