"""One PNG of one or more runs' metrics.jsonl: the curves people look at before reading JSON.

Panels: training and validation loss; learning rate; gradient norm; tokens/s with MFU on a
second axis; checkpoint blocking and background seconds per save. Resumes are vertical lines
on every panel, guard alarms are markers on the loss curve. Several runs overlay in their own
colours, e.g. a rehearsal's baseline and its killed-and-resumed run (scripts/plot_metrics.py,
scripts/rehearse.py).

A step logged twice (a resumed run re-runs the steps after its checkpoint) is drawn with its
last value, as metrics/records.py's ``step_losses`` reads it. Every drawn artist carries the gid
``"<run label>|<series>"``, so a test can compare what is drawn with the jsonl rows.
matplotlib (in the dev extra) is imported only when a plot is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from metrics.records import read_metrics

Series = Tuple[List[float], List[float]]  # (steps, values)
STEP_SERIES = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")


@dataclass
class RunSeries:
    label: str
    series: Dict[str, Series] = field(default_factory=dict)  # name -> (steps, values)
    resumes: List[int] = field(default_factory=list)  # steps a run resumed from
    alarms: List[int] = field(default_factory=list)  # steps with a guard alarm


def _last_per_step(rows: List[dict], key: str) -> Series:
    by_step = {r["step"]: r[key] for r in rows if r.get(key) is not None}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def run_series(run_dir: Path | str, label: str | None = None) -> RunSeries:
    """Everything the plot draws for one run, read from its metrics.jsonl."""
    run_dir = Path(run_dir)
    out = RunSeries(label or run_dir.name)
    steps = read_metrics(run_dir)
    for key in STEP_SERIES:
        s = _last_per_step(steps, key)
        if s[0]:
            out.series[key] = s
    for name, kind, key in (("val_loss", "eval", "val_loss"), ("checkpoint_blocking_s", "checkpoint", "blocking_s"),
                            ("checkpoint_background_s", "checkpoint", "background_s")):
        s = _last_per_step(read_metrics(run_dir, kind), key)
        if s[0]:
            out.series[name] = s
    out.resumes = sorted({r["step"] for r in read_metrics(run_dir, "resume")})
    out.alarms = sorted({r["step"] for r in read_metrics(run_dir, "alarm")})
    return out


def _labels(run_dirs: Sequence[Path]) -> List[str]:
    names = [Path(d).name for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def plot_runs(run_dirs: Sequence[Path | str], out: Path | str, title: str | None = None):
    """Write the PNG ``out`` for ``run_dirs`` (overlaid); returns the matplotlib Figure."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import PercentFormatter
    except ImportError as exc:
        raise SystemExit(f"plotting needs matplotlib ({exc}); install it: pip install matplotlib "
                         "(it is in the dev extra: pip install -e '.[dev]')") from exc
    runs = [run_series(d, label) for d, label in zip(run_dirs, _labels([Path(d) for d in run_dirs]))]
    fig = Figure(figsize=(12, 13), layout="constrained")
    axes = fig.subplots(5, 1, sharex=True)
    loss_ax, lr_ax, norm_ax, speed_ax, ckpt_ax = axes
    mfu_ax = speed_ax.twinx()
    panels = {"loss": (loss_ax, "-", "training loss"), "val_loss": (loss_ax, "D-", "validation loss"),
              "lr": (lr_ax, "-", "learning rate"), "grad_norm": (norm_ax, "-", "grad norm (before clipping)"),
              "tokens_per_s": (speed_ax, "-", "tokens/s"), "mfu": (mfu_ax, ":", "MFU"),
              "checkpoint_blocking_s": (ckpt_ax, "o-", "blocking s"),
              "checkpoint_background_s": (ckpt_ax, "s--", "background s")}
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for run, color in zip(runs, colors):
        for name, (steps, values) in run.series.items():
            ax, style, what = panels[name]
            emphasis = {"markersize": 7, "linewidth": 2.2, "zorder": 3} if name == "val_loss" else \
                {"markersize": 3, "linewidth": 1.2 if style == "-" else 1.0}
            (line,) = ax.plot(steps, values, style, color=color, label=f"{run.label}: {what}", **emphasis)
            line.set_gid(f"{run.label}|{name}")
        for i, step in enumerate(run.resumes):
            for ax in axes:
                vline = ax.axvline(step, color=color, linestyle="-.", linewidth=1,
                                   label=f"{run.label}: resumed from {step}" if ax is loss_ax else None)
                vline.set_gid(f"{run.label}|resume")
        if run.alarms and "loss" in run.series:
            by_step = dict(zip(*run.series["loss"]))
            hits = [s for s in run.alarms if s in by_step]
            (marks,) = loss_ax.plot(hits, [by_step[s] for s in hits], "x", color="red", markersize=9,
                                    markeredgewidth=2, label=f"{run.label}: guard alarm")
            marks.set_gid(f"{run.label}|alarms")
    loss_ax.set_ylabel("loss")
    lr_ax.set_ylabel("learning rate")
    norm_ax.set_ylabel("grad norm")
    speed_ax.set_ylabel("tokens/s")
    mfu_ax.set_ylabel("MFU")
    mfu_ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ckpt_ax.set_ylabel("checkpoint seconds")
    ckpt_ax.set_xlabel("step")
    for ax in (loss_ax, lr_ax, norm_ax, ckpt_ax):
        if ax.has_data():
            ax.legend(fontsize=7, loc="best")
    handles = speed_ax.get_legend_handles_labels()[0] + mfu_ax.get_legend_handles_labels()[0]
    if handles:
        speed_ax.legend(handles=handles, fontsize=7, loc="best")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title or ", ".join(r.label for r in runs))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return fig
