"""Real processes for the tests: train.py, torchrun, the scripts and the programs in tests/support/workers/.

Every process starts in the repository root with the test environment (subprocess_env), with
this checkout first on PYTHONPATH: the tests always run the code beside them, even when the
editable install (``pip install -e .``) points at another checkout (a git worktree, say).

``run`` and ``run_train`` fork python programs from a warm parent that imported torch and the
trainer once (support/warm.py): a real process, minus ~5 s of imports. ``torchrun --standalone
--nproc-per-node=N`` becomes N forked ranks with torchrun's environment. Cold starts remain where
the process itself is under test: the programs in COLD, a ``warm=False`` call, any other torchrun
flag (restarts, rendezvous), and ``support.processes.start``. TESTS_COLD_START=1 starts every run
cold, as before the warm parent existed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Dict, List, Sequence

from rehearsal.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "support" / "workers"
# For the tests' multi-node c10d rendezvous (--rdzv-conf): a lost node's agent is declared dead after
# keep_alive_interval x keep_alive_max_attempt seconds without its heartbeat (torchrun's default 5 x 3 =
# 15 s; 1 x 3 here), so a node-loss test waits seconds, not a quarter of a minute, for what it tests.
RDZV_KEEP_ALIVE = "keep_alive_interval=1,keep_alive_max_attempt=3"


def subprocess_env(extra: Dict[str, str] | None = None) -> Dict[str, str]:
    """rehearsal.processes.child_env with this checkout first on PYTHONPATH, then ``extra``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return child_env({"PYTHONPATH": path, **(extra or {})})


def worker(name: str) -> str:
    """The path of tests/support/workers/<name>.py."""
    return str(WORKERS / f"{name}.py")


def torchrun(nproc: int, *args: str) -> List[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=N ARGS``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def python_or_torchrun(nproc: int, script: str, *args: str) -> List[str]:
    """Plain python for one process, torchrun for more."""
    return [sys.executable, script, *args] if nproc == 1 else torchrun(nproc, script, *args)


# Programs whose test measures the process itself (what it imports, its peak memory): never forked.
COLD = ("import_boundaries.py", "peak_rss.py", "export_memory.py", "bench_init.py")


def warm_enabled() -> bool:
    return os.environ.get("TESTS_COLD_START", "") not in ("1", "true")


def run(cmd: Sequence[str], timeout: float = 600, warm: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repository root with subprocess_env(), capturing its text output; python
    programs forked from the warm parent unless ``warm=False`` (see the module docstring)."""
    kwargs.setdefault("cwd", ROOT)
    kwargs.setdefault("env", subprocess_env())
    if warm and warm_enabled() and set(kwargs) == {"cwd", "env"}:
        from support import warm as warm_parent

        parsed = warm_parent.parse(cmd)
        if parsed is not None and not Path(parsed[0][0]).name.endswith(COLD):
            return warm_parent.run(cmd, timeout=timeout, env=kwargs["env"], cwd=kwargs["cwd"])
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kwargs)


def run_train(overrides: Sequence[str], nproc: int = 1, timeout: float = 600, check: bool = True,
              extra_env: Dict[str, str] | None = None, warm: bool = True) -> subprocess.CompletedProcess:
    """Run train.py with Hydra overrides: plain python for one process, torchrun otherwise
    (forked from the warm parent unless ``warm=False``)."""
    cmd = python_or_torchrun(nproc, str(ROOT / "train.py"), *overrides)
    proc = run(cmd, timeout=timeout, env=subprocess_env(extra_env), warm=warm)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py imported as a module (scripts/ is not a package); sys.path is left as the script
    leaves it (some put the repository root first, as when run as a file)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
