"""What DCP's save planning costs the coordinator (rank 0) at 70B on 512 ranks, without the ranks.

The 70b model is built on the meta device and parallelised as in training (dp_shard x tp, a fake
process group); its state as a save holds it (every parameter, and AdamW's exp_avg and exp_avg_sq
of the same shape) gives each rank's write items from the placements, for all 512 mesh
coordinates, exactly as DCP's ``_create_write_items_for_dtensor`` computes them for its own rank.
Then the coordinator's side of a save is timed, in this process:

  first save        create_global_plan over every rank's plan (dedup, the global metadata,
                    validation), the storage writer's prefixes, and the pickled ``.metadata``
  a later save      with plan caching (checkpoint/durable/saver.py): each rank compares its plan
                    with its cached one and sends an empty plan; the coordinator reuses the cached
                    global plan and metadata

  python scripts/bench_dcp_planning.py                      # 70b, dp_shard 64 x tp 8
  python scripts/bench_dcp_planning.py --model 8b --dp-shard 8 --tp 1

Results are printed as JSON and a sentence; docs/checkpoint-format.md records them (70b: about 10
minutes and 2.2 GB of memory here, most of it building the 1.1 M write items in Python).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import pickle
import sys
import time

from rehearsal.bench import model_preset


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from model.llama import build_model
    from parallel.config import ParallelConfig
    from parallel.dims import resolve_parallel_dims
    from parallel.parallelize import parallelize_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="70b")
    parser.add_argument("--dp-shard", type=int, default=64)
    parser.add_argument("--tp", type=int, default=8)
    args = parser.parse_args(argv)
    world = args.dp_shard * args.tp

    mcfg = model_preset(args.model)
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    t0 = time.perf_counter()
    model = build_model(mcfg, materialize=False)
    parallelize_model(model, resolve_parallel_dims(1, args.dp_shard, args.tp, world),
                      ParallelConfig(dp_shard=args.dp_shard, tp=args.tp, device="cpu"), torch.device("cpu"),
                      seq_len=mcfg.max_seq_len)
    params = {n: p for n, p in model.named_parameters()}
    build_s = time.perf_counter() - t0

    # the saved tensors: "model.<fqn>", "optim.state.<fqn>.exp_avg|exp_avg_sq" (scalars aside)
    tensors = [(f"model.{n}", p) for n, p in params.items()]
    tensors += [(f"optim.state.{n}.{k}", p) for n, p in params.items() for k in ("exp_avg", "exp_avg_sq")]
    first = next(p for p in params.values() if isinstance(p, DTensor))
    ranks = first.device_mesh.mesh
    mesh_shape = tuple(ranks.shape)

    t0 = time.perf_counter()
    items = [[] for _ in range(world)]
    for fqn, p in tensors:
        props = TensorProperties.create_from_tensor(p.to_local())
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            sizes, offsets = _compute_local_shape_and_global_offset(p.shape, mesh_shape, list(coord), p.placements)
            sizes, offsets = torch.Size(sizes), torch.Size(offsets)
            items[int(ranks[coord])].append(WriteItem(
                index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                            properties=props, size=p.size())))
    # flatten_state_dict's mappings (fqn -> path in the nested state dict), as every rank sends them
    mappings = {fqn: tuple(fqn.split(".", 1)) for fqn, _ in tensors}
    plans = [SavePlan(rank_items, planner_data=dict(mappings)) for rank_items in items]
    local_s = time.perf_counter() - t0
    total_items = sum(len(i) for i in items)
    del items
    gc.collect()

    writer = FileSystemWriter("/nonexistent-unused")
    planner = DefaultSavePlanner(enable_plan_caching=True)
    SavePlanner._cached_all_plans.clear()
    t0 = time.perf_counter()
    global_plan, metadata = planner.create_global_plan(plans)
    global_plan = writer.prepare_global_plan(global_plan)
    first_plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    blob = pickle.dumps(metadata)
    pickle_s = time.perf_counter() - t0

    # a later save: rank 0 compares its local plan with the cached one; the coordinator gets empty plans
    from torch.distributed.checkpoint.planner_helpers import _compare_save_plans
    t0 = time.perf_counter()
    unchanged = _compare_save_plans(plans[0], plans[0])
    compare_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    delta, cached_metadata = planner.create_global_plan([SavePlan([], usable=False)] * world)
    writer.prepare_global_plan(delta)
    cached_plan_s = time.perf_counter() - t0
    assert unchanged and cached_metadata is metadata and not any(p.usable for p in delta)

    result = {"model": args.model, "world": world, "dp_shard": args.dp_shard, "tp": args.tp,
              "saved_tensors": len(tensors), "write_items": total_items,
              "items_per_rank": len(plans[0].items), "parallelize_s": round(build_s, 2),
              "local_plans_s": round(local_s, 2),
              "first_save_global_plan_s": round(first_plan_s, 2), "metadata_bytes": len(blob),
              "metadata_pickle_s": round(pickle_s, 2), "later_save_rank_compare_s": round(compare_s, 4),
              "later_save_global_plan_s": round(cached_plan_s, 4)}
    dist.destroy_process_group()
    print(json.dumps(result, indent=1))
    print(f"{args.model} on {world} ranks: {total_items:,} write items; coordinator's global plan "
          f"{first_plan_s:.1f} s and a {len(blob) / 2**20:.0f} MiB .metadata on the first save; with plan caching "
          f"a later save costs each rank {compare_s * 1e3:.0f} ms to compare its plan and the coordinator "
          f"{cached_plan_s * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
