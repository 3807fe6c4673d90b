"""How a run asks for data it does not have: the command that prepares it (printed in advice, and
run by data.prepare_if_missing in a process of its own, so that the preparation's code never enters
the training process), the folder name data.prepare_if_missing builds, and DataError, the error for
data that is missing or does not fit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

PREPARE_SCRIPT = "scripts/prepare_data.py"  # relative to the checkout, as the advice prints it
STDERR_TAIL = 20  # lines of a failed preparation's stderr that its DataError quotes


class DataError(ValueError):
    """Data that is missing or does not fit this run; the message says how to fix it."""


def prepared_name(sources: Sequence[str], tokenizer: str) -> str:
    """The folder name data.prepare_if_missing builds under: "<sources>-<tokenizer>" (pydoc-byte; for
    data.tokenizer=hf:/models/llama3/tokenizer.json, pydoc-hf-llama3)."""
    label = str(tokenizer)
    if label.startswith("hf:"):
        label = "hf-" + Path(label[3:]).parent.name
    return "+".join(Path(str(s)).stem for s in sources) + "-" + label


def prepare_args(path, sources: Sequence[str] = ("pydoc",), tokenizer: str = "byte", **options) -> List[str]:
    """scripts/prepare_data.py's arguments; ``options`` are more of its flags (validation_fraction=0.1 ->
    --validation-fraction 0.1; force=True -> --force)."""
    args = ["--out", str(path), "--sources", *map(str, sources), "--tokenizer", str(tokenizer)]
    for name, value in options.items():
        args += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return args


def prepare_command(path, sources: Sequence[str] = ("pydoc",), tokenizer: str = "byte", **options) -> str:
    return " ".join(["python", PREPARE_SCRIPT, *prepare_args(path, sources, tokenizer, **options)])


def run_preparation(path, sources: Sequence[str], tokenizer: str, **options) -> str:
    """Prepare ``path`` with scripts/prepare_data.py in a child process; its stdout. A failure is a
    DataError naming the command, its exit code and the end of its stderr."""
    script = Path(__file__).resolve().parents[1] / PREPARE_SCRIPT
    args = prepare_args(path, sources, tokenizer, **options)
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        command, tail = prepare_command(path, sources, tokenizer, **options), proc.stderr.rstrip().splitlines()
        raise DataError(f"data.prepare_if_missing could not prepare {path}: `{command}` exited with code "
                        f"{proc.returncode}; the end of its stderr:\n" + "\n".join(tail[-STDERR_TAIL:]))
    return proc.stdout
