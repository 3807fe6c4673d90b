"""scripts/gpu_check.py cannot rot: its dry run (CPU, tiny shapes) runs every part's code path and
reports each with a status; a part that overruns its limit is a failure that the next part survives."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys

import pytest

from support.launch import ROOT, run

PARTS = ["environment", "cuda_tests", "fsdp_eager", "fsdp_compile", "async_checkpoint", "probe_memory",
         "sigkill_resume", "memory_tier"]


@pytest.mark.distributed  # starts train.py (through scripts/instrumented.py) a dozen times
@pytest.mark.rehearsal  # about 70 s of a worker: .ci/run runs it after the suite, with the rehearsals
def test_dry_run_reports_every_part_with_a_status(tmp_path, pydoc_data):
    out = tmp_path / "report"
    proc = run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(out), "--data", str(pydoc_data),
                "--shm", str(tmp_path / "shm")], timeout=1100)  # the dry run's own budget is 1000 s
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
    assert {"tests/unit/test_init.py", "tests/unit/test_fsdp_one_rank.py"} <= set(cuda["results"]["files"])
    # The parts that need CUDA ran on CPU and say what a CPU cannot judge.
    for name in ("fsdp_eager", "fsdp_compile", "async_checkpoint", "probe_memory", "sigkill_resume", "memory_tier"):
        assert parts[name]["results"]["device"] == "cpu", name
    for name in ("fsdp_eager", "fsdp_compile", "async_checkpoint", "probe_memory", "memory_tier"):
        assert parts[name]["reason"].startswith("CPU: "), (name, parts[name]["reason"])

    eager, compiled = parts["fsdp_eager"]["results"], parts["fsdp_compile"]["results"]
    assert eager["planned"]["fits"] and eager["n_layers"] == compiled["n_layers"] >= 1
    assert eager["fsdp2"] and compiled["fsdp2"]  # the runs said they ran under FSDP2 (parallel.force_fsdp)
    assert eager["tokens_per_s"] > 0 and compiled["tokens_per_s"] > 0
    assert "TORCHDYNAMO_DISABLE" in compiled["note"]
    # the shadow check at step 6; the final save's (4): the save of step 2 takes step 3's first micro-batch as its probe
    assert parts["probe_memory"]["results"]["calls"] == {"fsdp_eager": 1, "async_checkpoint": 1}
    saved = parts["async_checkpoint"]["results"]
    assert saved["verified"] and saved["bytes"] > 0 and saved["copy_floor_s"] > 0 and saved["disk_write_gbps"] > 0
    killed = parts["sigkill_resume"]["results"]
    assert killed["killed_returncode"] == -9 and killed["resumed_from"] and killed["divergences"] == []
    assert (killed["mode"], killed["rtol"]) == ("deterministic", 0.0)  # bitwise
    assert parts["memory_tier"]["results"]["snapshots"] >= 2
    assert not list(out.glob("*/run/checkpoints/step_*")) and not list((tmp_path / "shm").glob("*"))


def _load(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    return gpu_check


# What torch reports for the two GPUs this check is meant for (nvidia-smi memory.total: 81,559 and 143,771 MiB).
GPUS = {"NVIDIA H100 80GB HBM3": 81559 / 1024, "NVIDIA H200": 143771 / 1024}


@pytest.mark.parametrize("gpu", list(GPUS))
def test_the_gpu_shapes_compose_validate_and_plan(tmp_path, monkeypatch, gpu):
    """The dry run uses the debug model for every shape: here the GPU overrides themselves (the 8b shape,
    seq 8192, FSDP2 at one rank in bf16, the fit-layers search) compose, pass train.py's validation at one
    rank and plan, in this process (the planner at one rank builds no process group)."""
    from trainer.preflight import validate_config

    gpu_check = _load(monkeypatch)
    check = gpu_check.Check(out=tmp_path, data=tmp_path / "data", dry_run=False, budget_s=480, shm=tmp_path)
    check.env = {"cuda_available": True, "gpu": gpu, "gpu_memory_gib": GPUS[gpu], "peak_tflops": 989.0}
    layers, device = gpu_check._fit_layers(check)
    assert device.memory_gib == GPUS[gpu] and 1 <= layers < 32
    cfg, _, plan_of = check.plan(check.shape("fit"), {**gpu_check.FSDP, "model.n_layers": layers})
    validate_config(cfg, world_size=1)
    assert (cfg.model.dim, cfg.model.vocab_size, cfg.training.seq_len) == (4096, 128256, 8192)
    assert (cfg.parallel.device, cfg.parallel.activation_checkpoint) == ("cuda", "selective")
    plan = plan_of(cfg)
    assert plan.fits and plan.dims.world_size == 1 and plan.dims.fsdp_enabled
    assert plan.workload.param_dtype == "bf16" and plan.fsdp_buffer_bytes > 0 and plan.activations.weight_copies == 0
    cfg.model.n_layers = layers + 1  # the search stopped at the largest that fits
    assert not plan_of(cfg).fits
    for shape in ("ckpt", "small"):
        cfg, _, plan_of = check.plan(check.shape(shape), {})
        validate_config(cfg, world_size=1)
        assert cfg.model.dim == 4096 and cfg.model.n_layers == 1 and plan_of(cfg).fits, shape
    assert check.plan(check.shape("small"), {})[0].model.vocab_size == 32768


def _cuda_guards(tree: ast.AST) -> list:
    """(owner, marks) of every CUDA guard in a test module: a ``skipif(not ...cuda...)`` among a test's
    decorators, a ``pytest.param``'s marks or ``pytestmark``; an ``if not ...cuda...: pytest.skip(...)`` in
    a test's body. ``marks`` are the sources of the marks next to it. (A skip when CUDA *is* there guards a
    CPU-only test: not counted.)"""
    def needs_cuda(node) -> bool:
        text = ast.unparse(node)
        return "cuda" in text and text.startswith("not ")

    out = []
    for node in ast.walk(tree):
        groups = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            groups.append((node.name, node.decorator_list))
            for inner in ast.walk(node):
                if isinstance(inner, ast.If) and needs_cuda(inner.test) and "pytest.skip(" in ast.unparse(inner):
                    out.append((node.name, [ast.unparse(d) for d in node.decorator_list]))
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("pytest.param"):
            groups += [(ast.unparse(node.args[0]) if node.args else "param", kw.value.elts)
                       for kw in node.keywords if kw.arg == "marks" and isinstance(kw.value, (ast.List, ast.Tuple))]
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            groups.append(("pytestmark", node.value.elts if isinstance(node.value, (ast.List, ast.Tuple))
                           else [node.value]))
        for owner, marks in groups:
            if any(isinstance(m, ast.Call) and ast.unparse(m.func).endswith("mark.skipif") and m.args
                   and needs_cuda(m.args[0]) for m in marks):
                out.append((owner, [ast.unparse(m) for m in marks]))
    return out


def test_every_cuda_guarded_test_is_marked_cuda():
    """gpu_check's cuda_tests part runs ``pytest -m cuda`` on the files that use the marker: a test that skips
    without CUDA but lacks the marker would never run on a lent GPU."""
    found = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for owner, marks in _cuda_guards(ast.parse(path.read_text())):
            found[f"{path.name}::{owner}"] = any(m.endswith("mark.cuda") for m in marks)
    unmarked = [name for name, marked in found.items() if not marked]
    assert unmarked == [], f"CUDA-guarded without @pytest.mark.cuda: {unmarked}"
    assert {"test_init.py::test_cuda_parameters_equal_cpu_parameters", "test_fsdp_one_rank.py::'cuda'"} <= set(found)


def test_the_cuda_guard_check_can_fail():
    unmarked = ast.parse("import pytest, torch\n"
                         "@pytest.mark.skipif(not torch.cuda.is_available(), reason='GPU')\ndef test_a(): pass\n"
                         "def test_b():\n    if not torch.cuda.is_available():\n        pytest.skip('GPU')\n"
                         "P = pytest.param('cuda',\n"
                         "                 marks=[pytest.mark.skipif(not torch.cuda.is_available(), reason='')])\n"
                         "@pytest.mark.skipif(torch.cuda.is_available(), reason='CPU only')\ndef test_c(): pass\n")
    assert [(owner, marks) for owner, marks in _cuda_guards(unmarked) if not any(m.endswith("mark.cuda")
                                                                              for m in marks)] == [
        ("test_a", ["pytest.mark.skipif(not torch.cuda.is_available(), reason='GPU')"]), ("test_b", []),
        ("'cuda'", ["pytest.mark.skipif(not torch.cuda.is_available(), reason='')"])]


def test_a_part_over_its_limit_fails_and_the_next_part_still_runs(tmp_path, monkeypatch):
    gpu_check = _load(monkeypatch)

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
