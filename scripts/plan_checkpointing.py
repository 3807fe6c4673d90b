"""How much does checkpointing cost, and how often should we do it? A table and plots.

For each model (1B, 8B, 70B: parameters from configs/model/), aggregate storage bandwidth
and checkpoint interval, the table gives

  sync overhead    C_sync / (T + C_sync), C_sync = full state / storage bandwidth
  async overhead   C_snap / (T + C_snap), C_snap = per-device shard / host copy bandwidth;
                   "n/a" when the background write (full state / bandwidth) is longer than T
                   (a save would wait for the previous one)
  lost/failure     T/2 + R (sync), T/2 + W + R (async): expected progress a failure costs

plus the Young/Daly interval T* = sqrt(2 M C) for both, with M = device MTBF / devices.
The state is parameters + AdamW moments in fp32 (12 bytes per parameter, --bytes-per-param).

    python scripts/plan_checkpointing.py --devices 1024 --out outputs/plan_checkpointing
"""

from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import OmegaConf

from model.config import ModelConfig
from model.counting import count_params
from recovery.interval import DEFAULT_DEVICE_MTBF_HOURS, cluster_mtbf_s, work_lost_per_failure_s, young_daly_interval_s

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("1b", "8b", "70b")


def model_params(name: str) -> int:
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "model" / f"{name}.yaml"))
    return count_params(ModelConfig(**cfg)).total


def costs(params: int, bytes_per_param: float, storage_gbps: float, devices: int, host_copy_gbps: float):
    """(state bytes, sync blocking C, async blocking C_snap, background write W) in seconds."""
    state = params * bytes_per_param
    write = state / (storage_gbps * 1e9)
    snapshot = state / devices / (host_copy_gbps * 1e9)
    return state, write, snapshot, write


def overhead(interval_s: float, blocking_s: float) -> float:
    return blocking_s / (interval_s + blocking_s)


def table(args) -> list:
    mtbf = cluster_mtbf_s(args.device_mtbf_hours, args.devices)
    rows = []
    for name in args.models:
        params = model_params(name)
        for bw in args.storage_gbps:
            state, c_sync, c_snap, write = costs(params, args.bytes_per_param, bw, args.devices, args.host_copy_gbps)
            t_sync, t_async = young_daly_interval_s(mtbf, c_sync), max(young_daly_interval_s(mtbf, c_snap), write)
            for label, t in [(f"{m:g} min", m * 60) for m in args.intervals_min] + [("T* sync", t_sync),
                                                                                      ("T* async", t_async)]:
                async_ok = write <= t
                rows.append(dict(
                    model=name, params=params, state_gb=state / 1e9, storage_gbps=bw, interval=label, interval_s=t,
                    sync_overhead=overhead(t, c_sync), async_overhead=overhead(t, c_snap) if async_ok else None,
                    lost_sync_s=work_lost_per_failure_s(t, args.restart_s),
                    lost_async_s=work_lost_per_failure_s(t, args.restart_s, write) if async_ok else None,
                    c_sync=c_sync, c_snap=c_snap, write=write))
    return rows


def print_table(rows, args) -> None:
    mtbf = cluster_mtbf_s(args.device_mtbf_hours, args.devices)
    print(f"{args.devices} devices, device MTBF {args.device_mtbf_hours:,.0f} h -> cluster MTBF {mtbf / 3600:.2f} h; "
          f"restart R={args.restart_s:.0f} s; host copy {args.host_copy_gbps:g} GB/s per device; "
          f"{args.bytes_per_param:g} bytes/param")
    head = (f"{'model':>5} {'state GB':>9} {'storage':>8} {'C sync':>8} {'C snap':>7} {'interval':>9} "
            f"{'T (s)':>8} {'sync ovh':>9} {'async ovh':>9} {'lost sync':>10} {'lost async':>10}")
    print(head)
    print("-" * len(head))

    def pct(v):
        return "n/a" if v is None else f"{100 * v:.3f}%"

    def secs(v):
        return "n/a" if v is None else f"{v:.0f} s"

    for r in rows:
        print(f"{r['model']:>5} {r['state_gb']:>9.1f} {r['storage_gbps']:>5g}GB/s {r['c_sync']:>7.1f}s "
              f"{r['c_snap']:>6.2f}s {r['interval']:>9} {r['interval_s']:>8.0f} {pct(r['sync_overhead']):>9} "
              f"{pct(r['async_overhead']):>9} {secs(r['lost_sync_s']):>10} {secs(r['lost_async_s']):>10}")


def plot(rows, args, out: Path) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    mtbf = cluster_mtbf_s(args.device_mtbf_hours, args.devices)
    written = []
    grid = [60 * m for m in (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240)]
    for name in args.models:
        params = model_params(name)
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for bw in args.storage_gbps:
            _, c_sync, c_snap, write = costs(params, args.bytes_per_param, bw, args.devices, args.host_copy_gbps)
            total_sync = [100 * (overhead(t, c_sync) + work_lost_per_failure_s(t, args.restart_s) / mtbf) for t in grid]
            total_async = [100 * (overhead(t, c_snap) + work_lost_per_failure_s(t, args.restart_s, write) / mtbf)
                           if write <= t else float("nan") for t in grid]
            ax1.plot([t / 60 for t in grid], total_sync, marker="o", label=f"sync {bw:g} GB/s")
            ax1.plot([t / 60 for t in grid], total_async, marker="x", linestyle="--", label=f"async {bw:g} GB/s")
            ax2.plot([t / 60 for t in grid], [work_lost_per_failure_s(t, args.restart_s, write) / 60 for t in grid],
                     label=f"async, {bw:g} GB/s")
        ax1.set(xscale="log", yscale="log", xlabel="checkpoint interval (min)", ylabel="expected waste (% of time)",
                title=f"{name}: checkpoint + failure waste, {args.devices} devices")
        ax2.set(xscale="log", xlabel="checkpoint interval (min)", ylabel="work lost per failure (min)",
                title=f"{name}: expected loss per failure")
        ax1.legend(fontsize=7)
        ax2.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"checkpoint_waste_{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--storage-gbps", type=float, nargs="+", default=[1.0, 10.0, 100.0],
                   help="aggregate storage write bandwidth, GB/s")
    p.add_argument("--intervals-min", type=float, nargs="+", default=[5, 15, 30, 60])
    p.add_argument("--devices", type=int, default=1024)
    p.add_argument("--device-mtbf-hours", type=float, default=DEFAULT_DEVICE_MTBF_HOURS)
    p.add_argument("--host-copy-gbps", type=float, default=10.0, help="device-to-host staging bandwidth per device")
    p.add_argument("--restart-s", type=float, default=300.0, help="recovery time R (measured MTTR)")
    p.add_argument("--bytes-per-param", type=float, default=12.0)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "plan_checkpointing")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    rows = table(args)
    print_table(rows, args)
    if not args.no_plots:
        for path in plot(rows, args, args.out):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
