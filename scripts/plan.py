"""Plan a layout before renting the cluster: parameters, per-rank bytes for parameters,
gradients, optimizer state and activations, whether that fits the device, an estimated step
time and MFU, checkpoint bytes per rank and in total, and the time to snapshot and to write
a checkpoint. Nothing is allocated (meta device, fake process group).

  python scripts/plan.py +experiment=70b parallel.dp_shard=64 parallel.tp=8
  python scripts/plan.py +experiment=70b parallel.tp=8 --world-size 512 --storage-gbps 100 --json
  python scripts/plan.py +experiment=70b parallel.dp_shard=64 parallel.tp=8 --system h200 \
      parallel.activation_checkpoint=none
  python scripts/plan.py +experiment=70b parallel.dp_shard=64 parallel.tp=8 --nic-gbps 90 --nvlink-gbps 400

--system picks a GPU system's defaults (memory, peak, NVLink and per-GPU NIC bandwidths); any
other option overrides one of them.

Arguments other than the --options are Hydra overrides, as for train.py. The arithmetic
lives in planner/plan.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    from hydra import compose, initialize_config_dir

    from planner.comm_model import DEFAULT_SYSTEM, SYSTEMS
    from planner.plan import (
        DEFAULT_HOST_COPY_GBPS,
        DEFAULT_STORAGE_GBPS,
        Device,
        format_plan,
        plan_as_dict,
        plan_from_config,
    )
    from trainer.config import register
    from trainer.preflight import check

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=None, help="needed when parallel.dp_shard=-1")
    parser.add_argument("--host-copy-gbps", type=float, default=DEFAULT_HOST_COPY_GBPS,
                        help="device-to-host copy bandwidth of one rank, GB/s")
    parser.add_argument("--storage-gbps", type=float, default=DEFAULT_STORAGE_GBPS,
                        help="aggregate write bandwidth of the checkpoint storage, GB/s")
    defaults = Device()
    parser.add_argument("--system", choices=sorted(SYSTEMS), default=DEFAULT_SYSTEM,
                        help="GPU system whose numbers are the defaults of the options below")
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="memory of one device, GiB (the fits / does not fit verdict)")
    parser.add_argument("--device-tflops", type=float, default=None,
                        help="dense bf16 peak of one device, TFLOP/s (step time and MFU)")
    parser.add_argument("--compute-efficiency", type=float, default=defaults.efficiency,
                        help="fraction of the peak the step's FLOPs run at (fitted to published throughput)")
    parser.add_argument("--reserve-gib", type=float, default=defaults.reserve_gib,
                        help="per-device memory set aside for the CUDA context, NCCL and fragmentation")
    parser.add_argument("--nvlink-gbps", type=float, default=None,
                        help="achievable bus bandwidth of a collective inside a node, GB/s")
    parser.add_argument("--nic-gbps", type=float, default=None,
                        help="achievable bus bandwidth per GPU between nodes, GB/s")
    parser.add_argument("--gpus-per-node", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args, overrides = parser.parse_known_args(argv)

    register()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    config, _ = check(cfg)
    try:
        device = _device(args, SYSTEMS[args.system], Device)
        plan = plan_from_config(config, args.world_size, args.host_copy_gbps, args.storage_gbps, device)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan_as_dict(plan), indent=2) if args.json else format_plan(plan))
    return 0


def _device(args, system, device_type):
    """The device the plan is for: the system's numbers, each overridden by its option if given."""
    given = {"memory_gib": args.device_memory_gib, "tflops": args.device_tflops, "nvlink_gbps": args.nvlink_gbps,
             "nic_gbps": args.nic_gbps, "gpus_per_node": args.gpus_per_node}
    for key, value in [*given.items(), ("efficiency", args.compute_efficiency), ("reserve_gib", args.reserve_gib)]:
        if value is not None and not (value > 0 or (key == "reserve_gib" and value == 0)):
            flags = {"memory_gib": "device-memory-gib", "tflops": "device-tflops", "efficiency": "compute-efficiency"}
            flag = flags.get(key, key.replace("_", "-"))
            raise ValueError(f"--{flag} {value}: must be a positive number")
    if not args.compute_efficiency <= 1:
        raise ValueError(f"--compute-efficiency {args.compute_efficiency}: a fraction of the peak, at most 1")
    defaults = {"memory_gib": system.memory_gib, "tflops": system.peak_tflops, "nvlink_gbps": system.nvlink_gbps,
                "nic_gbps": system.nic_gbps, "gpus_per_node": system.gpus_per_node}
    chosen = {k: defaults[k] if v is None else v for k, v in given.items()}
    return device_type(efficiency=args.compute_efficiency, reserve_gib=args.reserve_gib, **chosen)


if __name__ == "__main__":
    sys.exit(main())
