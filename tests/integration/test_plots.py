"""scripts/plot_metrics.py: the PNG is written, and every drawn series is the run's metrics.jsonl
as metrics/records.py reads it (not pixels): a real run with evaluations, checkpoint saves, a
guard alarm and a resume, overlaid with a second run."""

from __future__ import annotations

import sys
from collections import defaultdict

import numpy as np
import pytest

from metrics.plots import plot_runs
from metrics.records import read_metrics, step_losses
from rehearsal.runs import debug_overrides
from support.launch import ROOT, run, run_train

pytestmark = pytest.mark.distributed  # the runs are train.py processes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(pydoc_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("plots")
    extra = {"checkpoint.interval": 4, "checkpoint.keep_last": 3, "eval.interval": 2,
             "recovery.guards.warmup_steps": 4}
    resumed = root / "resumed"  # a flipped gradient bit at step 6 (an alarm), stopped at 8, then resumed to 12
    run_train(debug_overrides(resumed, pydoc_data, steps=8, extra={
        **extra, "+recovery.faults": "[{kind: bitflip_grad, phase: gradients, step: 6, rank: 0}]"}))
    run_train(debug_overrides(resumed, pydoc_data, steps=12, extra=extra))
    baseline = root / "baseline"
    run_train(debug_overrides(baseline, pydoc_data, steps=12, extra=extra))
    return baseline, resumed


def drawn(fig) -> dict:
    """gid -> [(x, y) of each artist with that gid]."""
    out = defaultdict(list)
    for ax in fig.axes:
        for line in ax.lines:
            if line.get_gid():
                out[line.get_gid()].append((np.asarray(line.get_xdata()), np.asarray(line.get_ydata())))
    return out


def expected(run_dir) -> dict:
    """The same series, read independently from metrics.jsonl with metrics/records.py."""
    rows = {r["step"]: r for r in read_metrics(run_dir)}  # a step logged twice: its last row
    losses = step_losses(run_dir)
    out = {"loss": (sorted(losses), [losses[s] for s in sorted(losses)])}
    for key in ("lr", "grad_norm", "tokens_per_s", "mfu"):
        out[key] = (sorted(rows), [rows[s][key] for s in sorted(rows)])
    for name, kind, key in (("val_loss", "eval", "val_loss"), ("checkpoint_blocking_s", "checkpoint", "blocking_s"),
                            ("checkpoint_background_s", "checkpoint", "background_s")):
        events = {r["step"]: r[key] for r in read_metrics(run_dir, kind)}
        out[name] = (sorted(events), [events[s] for s in sorted(events)])
    return out


def test_the_png_draws_exactly_the_jsonl_series(runs, tmp_path):
    baseline, resumed = runs
    out = tmp_path / "both.png"
    fig = plot_runs([baseline, resumed], out)
    assert out.read_bytes()[:8] == PNG_MAGIC
    from matplotlib.image import imread
    assert imread(out).shape[:2] == (1300, 1200)

    artists = drawn(fig)
    for run_dir in runs:
        for name, (steps, values) in expected(run_dir).items():
            [(x, y)] = artists[f"{run_dir.name}|{name}"]
            assert steps and x.tolist() == steps and y.tolist() == values, (run_dir.name, name)
    assert artists[f"{baseline.name}|val_loss"][0][0].tolist() == [2, 4, 6, 8, 10, 12]
    # the resume: a vertical line at step 8 on each of the five panels; the alarm: a marker on the loss
    [resume] = read_metrics(resumed, "resume")
    lines = artists[f"{resumed.name}|resume"]
    assert resume["step"] == 8 and len(lines) == 5 and all(x.tolist() == [8, 8] for x, _ in lines)
    [alarm] = read_metrics(resumed, "alarm")
    [(x, y)] = artists[f"{resumed.name}|alarms"]
    assert alarm["step"] == 6 and x.tolist() == [6] and y.tolist() == [step_losses(resumed)[6]]
    assert f"{baseline.name}|resume" not in artists and f"{baseline.name}|alarms" not in artists
    colors = {ax.lines[i].get_color() for ax in fig.axes[:1] for i in range(len(ax.lines))
              if ax.lines[i].get_gid() in (f"{baseline.name}|loss", f"{resumed.name}|loss")}
    assert len(colors) == 2  # overlaid runs in their own colours


def test_the_script_writes_the_png_and_names_a_run_without_metrics(runs, tmp_path):
    baseline, resumed = runs
    out = tmp_path / "cli.png"
    proc = run([sys.executable, str(ROOT / "scripts" / "plot_metrics.py"), str(baseline), str(resumed),
                "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_bytes()[:8] == PNG_MAGIC and f"wrote {out}" in proc.stdout
    proc = run([sys.executable, str(ROOT / "scripts" / "plot_metrics.py"), str(tmp_path)], timeout=300)
    assert proc.returncode == 2 and f"no metrics.jsonl in {tmp_path}" in proc.stderr
