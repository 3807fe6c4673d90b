"""Per-step metrics: a log line every log_interval steps, metrics.jsonl every step (rank 0),
and optional wandb (never crashes a run; resumes its own run id) and TensorBoard.

Events (checkpoint saves, resumes, alarms, rollbacks, evaluations) go to metrics.jsonl as
rows with a ``kind``, and to the backends: each numeric field as the scalar
``<kind>/<field>`` and a running count ``events/<kind>`` at the event's step (TensorBoard);
in wandb the same keys, charted against their own ``<kind>/step`` axis (an async save is
reported a few steps after the step it saved, and wandb drops rows older than its current
step), plus the summary fields ``events/<kind>_count`` and ``last_<kind>``. The validation
loss is the top-level scalar ``val_loss`` beside ``loss``."""

from __future__ import annotations

import json
import logging
import os
import resource
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from metrics.config import LoggingConfig
from metrics.records import METRICS_FILE

log = logging.getLogger("trainer")


def setup_logging(level: str, rank: int) -> None:
    """Rank 0 logs at ``level``; other ranks only warnings and errors, tagged with the rank."""
    fmt = f"%(asctime)s [rank{rank}] %(levelname)s %(message)s"
    logging.basicConfig(level=level if rank == 0 else "WARNING", format=fmt, datefmt="%H:%M:%S", force=True)


def memory_gib(device: torch.device) -> float:
    """Peak accelerator memory, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _format_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class MetricsLogger:
    def __init__(self, run_dir: Path, lg: LoggingConfig, is_main: bool, total_steps: int, run_name: str = "",
                 config: Optional[Dict[str, Any]] = None):
        """``lg``: the logging section; ``run_name`` and ``config`` (the resolved config) name the run in wandb."""
        self.is_main = is_main
        self.total_steps = total_steps
        self.log_interval = max(1, lg.log_interval)
        self._jsonl = None
        self.attempt: Optional[int] = None  # the attempt lease's number once taken: every row carries it
        self._wandb = None
        self._tb = None
        self._event_counts: Counter = Counter()
        self._wandb_axes: set = set()  # event kinds whose wandb charts have their step axis defined
        if not is_main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (run_dir / METRICS_FILE).open("a", buffering=1)
        if lg.wandb.mode != "disabled":
            self._wandb = _start_wandb(run_dir, lg.wandb, run_name, config or {})
        if lg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log_step(self, step: int, metrics: Dict[str, Any], step_seconds_avg: float) -> None:
        """``step`` is the 1-based number of optimizer steps done."""
        if not self.is_main:
            return
        record = {"step": step, **self._attempt(), **metrics}
        self._jsonl.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            try:
                self._wandb.log(metrics, step=step)  # a step replayed after a resume is older: wandb drops it
            except Exception as exc:  # a metrics backend must never stop training
                log.warning("wandb logging at step %d failed: %s: %s", step, type(exc).__name__, exc)
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        if step % self.log_interval == 0 or step == self.total_steps:
            eta = _format_eta((self.total_steps - step) * step_seconds_avg)
            mfu = (f" | {metrics['tflops_per_device']:.3g} TFLOP/s/device | MFU {100 * metrics['mfu']:.3g}%"
                   if "mfu" in metrics else "")
            log.info(
                "step %d/%d | loss %.4f | lr %.3e | grad_norm %.3f | %.0f tok/s%s | %.0f ms | mem %.2f GiB | eta %s",
                step, self.total_steps, metrics["loss"], metrics["lr"], metrics["grad_norm"],
                metrics["tokens_per_s"], mfu, 1000 * metrics["step_s"], metrics["memory_gib"], eta,
            )

    def _attempt(self) -> Dict[str, int]:
        return {} if self.attempt is None else {"attempt": self.attempt}

    def log_eval(self, step: int, loss: float, tokens: int, seconds: float) -> None:
        """A validation result after 1-based ``step`` (training/evaluate.py)."""
        if not self.is_main:
            return
        log.info("eval after step %d | val_loss %.4f | %d tokens | %.2f s", step, loss, tokens, seconds)
        self.log_event(step, kind="eval", val_loss=loss, val_tokens=tokens, eval_s=seconds)
        self._to_backends(step, {"val_loss": loss})  # beside "loss", on the training step axis

    def log_event(self, step: int, **fields) -> None:
        """Non-step records (checkpoint timings, resumes, alarms, evaluations): metrics.jsonl with a
        kind, and the wandb and TensorBoard scalars described in the module docstring."""
        if not self.is_main:
            return
        self._jsonl.write(json.dumps({"step": step, **self._attempt(), **fields}) + "\n")
        kind = str(fields.get("kind", "event"))
        self._event_counts[kind] += 1
        scalars = {f"{kind}/{k}": v for k, v in fields.items() if _is_number(v)}
        scalars[f"events/{kind}"] = self._event_counts[kind]
        self._to_backends(step, scalars, kind)
        if self._wandb is not None:
            try:
                summary = self._wandb.summary
                summary[f"events/{kind}_count"] = summary.get(f"events/{kind}_count", 0) + 1
                summary[f"last_{kind}"] = {"step": step, **{k: v for k, v in fields.items() if k != "kind"}}
            except Exception as exc:  # a metrics backend must never stop training
                log.warning("wandb summary of a %s event failed: %s: %s", kind, type(exc).__name__, exc)

    def _to_backends(self, step: int, scalars: Dict[str, Any], kind: Optional[str] = None) -> None:
        """TensorBoard scalars at ``step``; wandb at its current step (never an older one, which it
        drops), an event's keys charted against their own ``<kind>/step`` axis."""
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is None:
            return
        try:
            row = dict(scalars)
            if kind is not None:
                if kind not in self._wandb_axes:
                    self._wandb.define_metric(f"{kind}/step")
                    for pattern in (f"{kind}/*", f"events/{kind}"):
                        self._wandb.define_metric(pattern, step_metric=f"{kind}/step")
                    self._wandb_axes.add(kind)
                row[f"{kind}/step"] = step
            self._wandb.log(row, step=max(step, self._wandb.step))
        except Exception as exc:
            log.warning("wandb logging at step %d failed: %s: %s", step, type(exc).__name__, exc)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _start_wandb(run_dir: Path, w, run_name: str, config: Dict[str, Any]) -> Optional[Any]:
    """Start or resume this run's wandb run (``w``: logging.wandb); on any failure log why and go on without it."""
    try:
        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        if w.mode == "online" and not os.environ.get("WANDB_API_KEY"):
            log.warning("logging.wandb.mode=online but WANDB_API_KEY is unset: wandb may fail to log in")
        return wandb.init(project=w.project, entity=w.entity, name=run_name, id=run_id, resume="allow",
                          dir=str(run_dir), mode=w.mode, config=config)
    except Exception as exc:  # a metrics backend must never stop training
        log.warning("wandb disabled for this run: %s: %s", type(exc).__name__, exc)
        return None
