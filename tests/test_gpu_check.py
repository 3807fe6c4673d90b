"""scripts/gpu_check.py cannot rot: its dry run (CPU, tiny shapes) runs every part's code path and
reports each with a status; a part that overruns its limit is a failure that the next part survives."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from helpers.launch import ROOT, run

PARTS = ["environment", "cuda_tests", "fsdp_eager", "fsdp_compile", "async_checkpoint", "probe_memory",
         "sigkill_resume", "memory_tier"]


@pytest.mark.distributed  # starts train.py (through tools/instrumented.py) a dozen times
def test_dry_run_reports_every_part_with_a_status(tmp_path, pydoc_data):
    out = tmp_path / "report"
    proc = run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(out), "--data", str(pydoc_data),
                "--shm", str(tmp_path / "shm")], timeout=600)
    assert f"report folder {out}" in proc.stdout, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    markdown = (out / "report.md").read_text()
    parts = {p["name"]: p for p in report["parts"]}
    assert list(parts) == PARTS
    assert all(f"| {name} | {parts[name]['status']} |" in markdown for name in PARTS)
    failed = {n: (p["reason"], p["results"].get("traceback")) for n, p in parts.items() if p["status"] != "pass"
              and n != "cuda_tests"}
    assert failed == {} and proc.returncode == 0, failed

    assert report["environment"]["cuda_available"] is False
    cuda = parts["cuda_tests"]  # pytest -m cuda ran and found the CUDA-only tests, all skipped here
    assert cuda["status"] == "skipped" and "no CUDA device" in cuda["reason"]
    assert cuda["results"]["tests"] == cuda["results"]["skipped"] >= 1
    assert "tests/test_init.py" in cuda["results"]["files"]
    # The parts that need CUDA ran on CPU and say what a CPU cannot judge.
    for name in ("fsdp_eager", "fsdp_compile", "async_checkpoint", "probe_memory", "sigkill_resume", "memory_tier"):
        assert parts[name]["results"]["device"] == "cpu", name
    for name in ("fsdp_eager", "fsdp_compile", "async_checkpoint", "probe_memory", "memory_tier"):
        assert parts[name]["reason"].startswith("CPU: "), (name, parts[name]["reason"])

    eager, compiled = parts["fsdp_eager"]["results"], parts["fsdp_compile"]["results"]
    assert eager["planned"]["fits"] and eager["n_layers"] == compiled["n_layers"] >= 1
    assert eager["tokens_per_s"] > 0 and compiled["tokens_per_s"] > 0
    assert "TORCHDYNAMO_DISABLE" in compiled["note"]
    assert parts["probe_memory"]["results"]["calls"] == {"fsdp_eager": 1, "async_checkpoint": 2}  # step 6; saves 2, 4
    saved = parts["async_checkpoint"]["results"]
    assert saved["verified"] and saved["bytes"] > 0 and saved["copy_floor_s"] > 0 and saved["disk_write_gbps"] > 0
    killed = parts["sigkill_resume"]["results"]
    assert killed["killed_returncode"] == -9 and killed["resumed_from"] and killed["divergences"] == []
    assert (killed["mode"], killed["rtol"]) == ("deterministic", 0.0)  # bitwise
    assert parts["memory_tier"]["results"]["snapshots"] >= 2
    assert not list(out.glob("*/run/checkpoints/step_*")) and not list((tmp_path / "shm").glob("*"))


def test_a_part_over_its_limit_fails_and_the_next_part_still_runs(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)

    def sleeper(check, deadline):
        check.run([sys.executable, "-c", "import time; time.sleep(60)"], deadline, tmp_path / "sleep.log")
        return "pass", "", {}

    monkeypatch.setitem(gpu_check.PARTS, "cuda_tests", sleeper)
    monkeypatch.setitem(gpu_check.LIMITS, "cuda_tests", (0.5, 0.5))
    monkeypatch.setattr(gpu_check, "MIN_PART_S", 0.0)
    check = gpu_check.Check(out=tmp_path, data=tmp_path, dry_run=True, budget_s=100, shm=tmp_path)
    over = gpu_check.run_part(check, "cuda_tests")
    assert over.status == "fail" and "over its 0.5 s limit" in over.reason, over
    broken = gpu_check.run_part(check, "probe_memory")  # nothing ran before it: skipped, with the reason
    assert broken.status == "skipped" and "fsdp_eager" in broken.reason
    check.budget_s = 0  # spent: every later part is skipped and says so
    assert gpu_check.run_part(check, "memory_tier").status == "skipped"
