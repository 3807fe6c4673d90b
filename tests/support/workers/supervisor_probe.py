"""Run by test_recovery_fallback.py: the forking supervisor with a test-only hook, kept out of pytest's process.

  python tests/support/workers/supervisor_probe.py SPEC.json RESULTS.json

The hook: after step 4 of the "probe" scenario commits, its stored probe loss is rewritten
(checksums stay valid), so only resume verification can tell the checkpoint is wrong.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import recovery.faults as faults
from rehearsal.supervisor import main

_original = faults.FaultInjector.maybe_inject


def _hooked(self, phase, step, model=None, path=None):
    if phase == "checkpoint_committed" and step == 4 and path is not None and "/probe/checkpoints" in str(path):
        manifest = Path(path) / "manifest.json"
        data = json.loads(manifest.read_text())
        data["probe_loss"] = data["probe_loss"] * (1 + 1e-6)
        manifest.write_text(json.dumps(data))
    return _original(self, phase, step, model=model, path=path)


if __name__ == "__main__":
    faults.FaultInjector.maybe_inject = _hooked
    main(sys.argv[1:])
