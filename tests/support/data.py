"""Build data pipelines the way train.py does, for the data tests."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Tuple

import numpy as np
import torch
from omegaconf import OmegaConf

from data.batching import make_batch_plan
from data.config import DataConfig, DataSourceConfig
from data.setup import build_data_pipeline

CPU_WORLD = SimpleNamespace(local_rank=0, device=torch.device("cpu"))


def data_config(path: Path | None = None, mixture: Dict[Path, float] | None = None, **fields):
    cfg = DataConfig(path=str(path or ""), **fields)
    cfg.mixture = [DataSourceConfig(path=str(p), weight=w) for p, w in (mixture or {}).items()]
    return OmegaConf.structured(cfg)


def pipeline(data_cfg, dp: int, rank: int, global_batch: int = 8, micro: int = 2, seq_len: int = 32,
             seed: int = 1234, allow_global_batch_change: bool = False):
    plan = make_batch_plan(global_batch, micro, dp)
    return build_data_pipeline(data_cfg, seq_len, seed, plan, rank, CPU_WORLD, model_vocab_size=100_000,
                               allow_global_batch_change=allow_global_batch_change)


def global_batches(data_cfg, dp: int, steps: int, state: dict | None = None, **kw
                   ) -> List[Tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
    """(sample ids, inputs, targets) of each global batch, gathered from every rank's loader.

    Ranks run one after another (each with its own loader and workers), as separate
    processes would; their slices are concatenated in rank order.
    """
    per_rank = []
    for rank in range(dp):
        pipe = pipeline(data_cfg, dp, rank, **kw)
        if state is not None:
            pipe.load_state_dict(state)
        rows = []
        for step in range(pipe.step, pipe.step + steps):
            ids = np.concatenate(pipe.upcoming_sample_ids())
            micro = pipe.next_micro_batches(step)
            assert len(micro) == pipe.plan.grad_accum_steps
            rows.append((ids, torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])))
        pipe.close()
        per_rank.append(rows)
    return [(np.concatenate([r[s][0] for r in per_rank]), torch.cat([r[s][1] for r in per_rank]),
             torch.cat([r[s][2] for r in per_rank])) for s in range(steps)]


def assert_same_batches(a, b) -> None:
    assert len(a) == len(b)
    for step, ((ids_a, x_a, y_a), (ids_b, x_b, y_b)) in enumerate(zip(a, b)):
        np.testing.assert_array_equal(ids_a, ids_b, err_msg=f"sample ids differ at step {step}")
        assert torch.equal(x_a, x_b), f"inputs differ at step {step}"
        assert torch.equal(y_a, y_b), f"targets differ at step {step}"


def pydoc_texts() -> List[str]:
    """The pydoc topics (the debug corpus's documents), in sorted order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]
