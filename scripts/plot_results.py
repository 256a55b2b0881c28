#!/usr/bin/env python3
"""Draws benches/results/h200.json as an SVG chart (standard library only).

For the backward and the forward: time against T (fused, the unfused baseline, the memory
speed of light, and for the backward the precise mode), both axes logarithmic; and % of the
speed of light against T.

    scripts/plot_results.py [RESULTS_JSON [OUT_SVG]]
        default: benches/results/h200.json -> benches/results/h200.svg
"""
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
W, H = 460, 300  # one panel
LEFT, RIGHT, TOP, BOTTOM = 58, 16, 34, 44
COLORS = {"fused": "#1f77b4", "precise": "#9467bd", "unfused": "#d62728", "sol": "#2ca02c",
          "ceiling": "#7f7f7f"}


def log_ticks(lo, hi):
    ticks = []
    for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        for m in (1, 2, 5):
            v = m * 10**e
            if lo <= v <= hi:
                ticks.append(v)
    return ticks


def panel(x0, y0, title, xs, series, ylog, ylabel, ymin=None, ymax=None):
    """One chart at (x0, y0): series is [(label, color, ys, dashed)]."""
    out = []
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    xlo, xhi = min(xs) / 1.15, max(xs) * 1.15
    ys_all = [y for _, _, ys, _ in series for y in ys if y is not None]
    ylo = ymin if ymin is not None else min(ys_all) / 1.2
    yhi = ymax if ymax is not None else max(ys_all) * 1.2

    def fx(x):
        return x0 + LEFT + pw * (math.log(x) - math.log(xlo)) / (math.log(xhi) - math.log(xlo))

    def fy(y):
        if ylog:
            t = (math.log(y) - math.log(ylo)) / (math.log(yhi) - math.log(ylo))
        else:
            t = (y - ylo) / (yhi - ylo)
        return y0 + TOP + ph * (1 - t)

    out.append(f'<rect x="{x0 + LEFT}" y="{y0 + TOP}" width="{pw}" height="{ph}" '
               'fill="none" stroke="#888"/>')
    out.append(f'<text x="{x0 + W / 2}" y="{y0 + 20}" text-anchor="middle" '
               f'font-size="14" font-weight="bold">{title}</text>')
    for t in [v for v in log_ticks(xlo, xhi) if v >= 500]:
        x = fx(t)
        out.append(f'<line x1="{x:.1f}" y1="{y0 + TOP}" x2="{x:.1f}" y2="{y0 + TOP + ph}" '
                   'stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{y0 + TOP + ph + 14}" text-anchor="middle" '
                   f'font-size="10">{t}</text>')
    out.append(f'<text x="{x0 + LEFT + pw / 2}" y="{y0 + H - 8}" text-anchor="middle" '
               'font-size="11">tokens T</text>')
    yt = log_ticks(ylo, yhi) if ylog else list(range(0, int(yhi) + 1, 20))
    for t in yt:
        if not ylo <= t <= yhi:
            continue
        y = fy(t)
        out.append(f'<line x1="{x0 + LEFT}" y1="{y:.1f}" x2="{x0 + LEFT + pw}" y2="{y:.1f}" '
                   'stroke="#eee"/>')
        out.append(f'<text x="{x0 + LEFT - 4}" y="{y + 3:.1f}" text-anchor="end" '
                   f'font-size="10">{t}</text>')
    out.append(f'<text x="{x0 + 14}" y="{y0 + TOP + ph / 2}" text-anchor="middle" font-size="11" '
               f'transform="rotate(-90 {x0 + 14} {y0 + TOP + ph / 2})">{ylabel}</text>')
    for i, (label, color, ys, dashed) in enumerate(series):
        pts = [(fx(x), fy(y)) for x, y in zip(xs, ys) if y is not None]
        dash = ' stroke-dasharray="5,3"' if dashed else ""
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8"{dash} points="'
                   + " ".join(f"{a:.1f},{b:.1f}" for a, b in pts) + '"/>')
        for a, b in pts:
            out.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2.2" fill="{color}"/>')
        ly = y0 + TOP + 12 + 14 * i
        lx = x0 + LEFT + 8
        out.append(f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 16}" y2="{ly - 4}" stroke="{color}" '
                   f'stroke-width="2"{dash}/>')
        out.append(f'<text x="{lx + 20}" y="{ly}" font-size="10">{label}</text>')
    return out


def section_panels(sec, name, x0, y0):
    cases = sorted(sec["cases"], key=lambda c: c["tokens"])
    xs = [c["tokens"] for c in cases]
    # Single calls where the section has them (and its copy ceiling), else back to back.
    single = all("single_us" in c for c in cases)
    key = (lambda k: {"fused": "single_us", "precise": "precise_single_us",
                      "unfused": "unfused_single_us"}[k]) if single else (lambda k: k + "_us")
    series = [("fused", COLORS["fused"], [c[key("fused")] for c in cases], False)]
    if all(c.get(key("precise")) for c in cases):
        series.append(("fused, precise", COLORS["precise"], [c[key("precise")] for c in cases],
                       False))
    # (The forward's unfused baseline is timed back to back only: left out beside single calls.)
    unfused = [c.get(key("unfused")) for c in cases]
    has_unfused = all(u is not None for u in unfused)
    if has_unfused:
        series.append(("unfused", COLORS["unfused"], unfused, False))
    if single:
        series.append(("copy ceiling", COLORS["ceiling"], [c["ceiling_us"] for c in cases], True))
    series.append(("speed of light", COLORS["sol"], [c["sol_us"] for c in cases], True))
    how = "single calls" if single else "back to back"
    time = panel(x0, y0, f"{name}: time (µs, {how})", xs, series, True, "µs")
    fused_pct = [100 * c["sol_us"] / c[key("fused")] for c in cases]
    pct = [("fused", COLORS["fused"], fused_pct, False)]
    if has_unfused:
        pct.append(("unfused", COLORS["unfused"], [100 * c["sol_us"] / u for c, u in
                                                   zip(cases, unfused)], False))
    mean_pct = sum(fused_pct) / len(fused_pct)
    sol = panel(x0 + W, y0, f"{name}: % of speed of light (mean {mean_pct:.1f}%)", xs,
                pct, False, "% SOL", 0, 100)
    return time + sol


def main():
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benches/results/h200.json"
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".svg")
    d = json.loads(src.read_text())
    sections = [("Backward", d)]
    if d.get("public_range"):
        sections.append(("Backward, public range", d["public_range"]))
    if "forward" in d:
        sections.append(("Forward", d["forward"]))
    height = H * len(sections) + 30
    body = []
    for i, (name, sec) in enumerate(sections):
        body += section_panels(sec, name, 0, H * i)
    body.append(f'<text x="8" y="{height - 10}" font-size="10" fill="#555">{d["device"]}; '
                f'cargo bench, medians (single calls after an L2 flush where the panel says '
                f'so, else back to back from CUDA graph replay); {src.name}</text>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{height}" '
           f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>'
           + "\n".join(body) + "</svg>\n")
    dst.write_text(svg)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
