"""How much does checkpointing cost, and how often should we do it? A table and plots.

For each model (1B, 8B, 70B: parameters from configs/model/), aggregate storage bandwidth
and checkpoint interval, the table gives

  sync overhead    C_sync / (T + C_sync), C_sync = probe + full state / storage bandwidth
  async overhead   C_snap / (T + C_snap), C_snap = probe + per-device shard / host copy bandwidth;
                   "n/a" when the background write (full state / bandwidth) is longer than T
                   (a save would wait for the previous one)
  lost/failure     T/2 + R (sync), T/2 + W + R (async): expected progress a failure costs

plus the Young/Daly interval T* = sqrt(2 M C) for both, with M = device MTBF / devices.
The state is parameters + AdamW moments in fp32 (12 bytes per parameter, --bytes-per-param).
Every durable save first runs the probe (recovery/probe.py: a forward of 4 sequences of
--seq-len tokens; a memory snapshot runs none, its restore compares bytes); the save's cost is the
planner's (planner/plan.py ``save_cost``, the numbers scripts/plan.py prints) with the state fully
sharded over the devices and each model at its tp degree (PROBE_TP).

A second table: goodput (useful time / wall time) at 1k, 10k and 100k devices (--scales) with
the durable tier alone (async saves at T* async; a failure restarts with R plus the storage
read of the whole state) and with a node-local memory tier in front of it (a snapshot every
--memory-interval steps, each rank's state in its node's host memory plus a replica on a peer
node; a node loss restarts with R plus a memory/peer read and loses half a memory interval;
only when the peer's copy is gone too, with probability P both, does it reload from storage).
``goodput`` is the analytic model; --simulate adds the seeded Monte Carlo of planner/simulate.py.

    python scripts/plan_checkpointing.py --devices 1024 --out outputs/plan_checkpointing
    python scripts/plan_checkpointing.py --no-plots --simulate --memory-stall-s 0.5 --memory-restore-s 10
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from model.counting import count_params
from parallel.dims import resolve_parallel_dims
from planner.plan import DEFAULT_HOST_COPY_GBPS, Device, SaveCost, save_cost
from planner.simulate import TwoTier, memory_interval, simulate_two_tier
from recovery.interval import (
    DEFAULT_DEVICE_MTBF_HOURS,
    choose_interval_steps,
    cluster_mtbf_s,
    work_lost_per_failure_s,
    young_daly_interval_s,
)
from rehearsal.bench import model_preset

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("1b", "8b", "70b")
# The tp degree each model's probe runs under: TP 8 inside a node at 70B (the 70b recipe, and torchtitan's
# published 70B run), FSDP alone below (torchtitan's 8B runs); a model not listed runs at tp 1.
PROBE_TP = {"1b": 1, "8b": 1, "70b": 8}


def model_params(name: str) -> int:
    return count_params(model_preset(name)).total


def save(name: str, devices: int, storage_gbps: float, args) -> SaveCost:
    """The planner's cost of one save of ``name`` on ``devices`` devices (its state sharded evenly over
    them), with the planner's default device (H100: peak, achievable fraction, NVLink and NIC)."""
    mcfg = model_preset(name)
    dims = resolve_parallel_dims(1, -1, PROBE_TP.get(name, 1), devices)
    total = count_params(mcfg).total
    return save_cost(mcfg, dims, math.ceil(total / devices), total, args.seq_len, Device(), args.host_copy_gbps,
                     storage_gbps, bytes_per_param=args.bytes_per_param)


def costs(name: str, storage_gbps: float, devices: int, args):
    """(state bytes, sync blocking C, async blocking C_snap, background write W) in seconds: a sync save
    blocks for the probe and the write, an async one for the probe and the host copy."""
    cost = save(name, devices, storage_gbps, args)
    state = model_params(name) * args.bytes_per_param
    return state, cost.probe_s + cost.write_s, cost.blocking_s, cost.write_s


def overhead(interval_s: float, blocking_s: float) -> float:
    return blocking_s / (interval_s + blocking_s)


def table(args) -> list:
    mtbf = cluster_mtbf_s(args.device_mtbf_hours, args.devices)
    rows = []
    for name in args.models:
        params = model_params(name)
        for bw in args.storage_gbps:
            state, c_sync, c_snap, write = costs(name, bw, args.devices, args)
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
          f"{args.bytes_per_param:g} bytes/param; every save first runs the probe ({_probe_note(args)})")
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


def _probe_note(args) -> str:
    tps = ", ".join(f"{m} tp {PROBE_TP.get(m, 1)}" for m in args.models)
    return f"4 x {args.seq_len} tokens of forward; {tps}; the planner's H100 defaults"


# -- two tiers: durable storage, and host memory with a peer replica ----------------------------------
def failure_free_wait_s(span_s: float, mtbf_s: float) -> float:
    """Expected wall time until ``span_s`` passes without a failure, when each failure starts it over."""
    return mtbf_s * math.expm1(span_s / mtbf_s)


def segment_wall_s(segment_s: float, mtbf_s: float, restart_s: float, write_s: float = 0.0) -> float:
    """Expected wall time per ``segment_s`` (training + stall) of progress between restore points.

    Daly's exponential model (2006): a failure loses the segment so far and costs a restart, which a failure
    can interrupt too; with ``write_s`` (an async save committing that long after it blocked) a failure
    within ``write_s`` of the save makes no progress. To first order this is recovery/interval.py's
    T + C + (T/2 + W + R) (T + C) / M."""
    lost = -math.expm1(-segment_s / mtbf_s)  # P(a failure within the segment)
    in_flight = -math.expm1(-write_s / mtbf_s)  # P(it strikes before the previous save committed)
    return (mtbf_s * lost + lost * failure_free_wait_s(restart_s + segment_s, mtbf_s)) / (1.0 - in_flight)


def double_loss_probability(policy: TwoTier, mtbf_s: float) -> float:
    """P(a node loss finds a rank's other copy gone): a ring neighbour (``peers_at_risk``) failed within the
    window a loss leaves one copy (restart, restore, next snapshot; stretched by failures in it). Node
    failures are independent; each node fails at 1 / (``mtbf_s`` x nodes)."""
    if not policy.memory:
        return 1.0
    window = failure_free_wait_s(policy.window_s, mtbf_s)
    return -math.expm1(-policy.peers_at_risk * window / (mtbf_s * policy.nodes))


def goodput(policy: TwoTier, mtbf_s: float, double_loss_p: float | None = None) -> float:
    """Useful training time / wall time of ``policy`` at cluster MTBF ``mtbf_s`` (planner/simulate.py checks it).

    Durable only: every segment ends in a save, a failure reloads from storage. With the memory tier: k
    snapshot segments per durable save, a failure restores from memory, and a fraction P both of failures
    additionally roll back to the last committed durable save (on average (k-1)/2 segments plus the
    in-flight write before the snapshot) and pay the storage read instead of the memory one."""
    if not policy.memory:
        segment = policy.durable_interval_s + policy.durable_blocking_s
        restart = policy.restart_s + policy.durable_reload_s
        return policy.durable_interval_s / segment_wall_s(segment, mtbf_s, restart, policy.durable_write_s)
    k, t = policy.durable_every, policy.memory_interval_s
    restart = policy.restart_s + policy.memory_restore_s
    wall = sum(segment_wall_s(t + policy.stall_s(i), mtbf_s, restart) for i in range(1, k + 1))
    p = double_loss_probability(policy, mtbf_s) if double_loss_p is None else double_loss_p
    extra = ((k - 1) / 2 * policy.mean_segment_wall_s + policy.durable_write_s + policy.durable_reload_s
             - policy.memory_restore_s)
    return k * t / wall * max(0.0, 1.0 - p * extra / mtbf_s)


def policies(name: str, devices: int, bw: float, args) -> tuple:
    """(durable-only, two-tier) policies of a model on ``devices`` devices at storage bandwidth ``bw``. A
    memory snapshot runs no probe (checkpoint/memory/snapshot.py compares the restored bytes instead): its
    default stall is the host copy alone; a durable save written from a snapshot still runs the probe."""
    mtbf = cluster_mtbf_s(args.device_mtbf_hours, devices)
    state, _, c_snap, write = costs(name, bw, devices, args)
    snapshot = save(name, devices, bw, args).snapshot_s
    nodes = math.ceil(devices / args.devices_per_node)
    durable = TwoTier(restart_s=args.restart_s, durable_interval_s=max(young_daly_interval_s(mtbf, c_snap), write),
                      durable_blocking_s=c_snap, durable_write_s=write, durable_reload_s=state / (bw * 1e9),
                      nodes=nodes)
    stall = snapshot if args.memory_stall_s is None else args.memory_stall_s
    restore = 2 * snapshot if args.memory_restore_s is None else args.memory_restore_s
    steps = args.memory_interval
    if steps == "auto":  # the copy to the peer (about a restore's transfer) must land before the next snapshot
        steps = choose_interval_steps(args.step_s, stall, restore, mtbf).steps
    # a durable save is written from the snapshot it rides on: it blocks only for what that stall did not cover
    two = TwoTier(restart_s=args.restart_s, durable_interval_s=durable.durable_interval_s,
                  durable_blocking_s=max(0.0, c_snap - stall), durable_write_s=write,
                  durable_reload_s=durable.durable_reload_s,
                  memory_interval_s=steps * args.step_s, memory_stall_s=stall, memory_restore_s=restore, nodes=nodes)
    return durable, two


def lost_per_failure_s(policy: TwoTier, mtbf_s: float) -> float:
    """Expected progress plus restart a failure costs (first order, as in the first table)."""
    durable = work_lost_per_failure_s(policy.durable_every * policy.segment_s,
                                      policy.restart_s + policy.durable_reload_s, policy.durable_write_s)
    if not policy.memory:
        return durable
    p = double_loss_probability(policy, mtbf_s)
    memory = work_lost_per_failure_s(policy.memory_interval_s, policy.restart_s + policy.memory_restore_s)
    return (1 - p) * memory + p * durable


def two_tier_table(args) -> list:
    rows = []
    for name in args.models:
        for bw in args.storage_gbps:
            for devices in args.scales:
                mtbf = cluster_mtbf_s(args.device_mtbf_hours, devices)
                durable, two = policies(name, devices, bw, args)
                row = dict(model=name, storage_gbps=bw, devices=devices, nodes=two.nodes, mtbf_s=mtbf,
                           durable=durable, two=two, p_both=double_loss_probability(two, mtbf),
                           lost_durable_s=lost_per_failure_s(durable, mtbf), lost_two_s=lost_per_failure_s(two, mtbf),
                           goodput_durable=goodput(durable, mtbf), goodput_two=goodput(two, mtbf))
                if args.simulate:
                    row["sim_durable"] = simulate_two_tier(durable, mtbf, trials=args.trials, seed=args.seed).ratio
                    row["sim_two"] = simulate_two_tier(two, mtbf, trials=args.trials, seed=args.seed).ratio
                rows.append(row)
    return rows


def print_two_tier(rows, args) -> None:
    stall = "per-device shard / host copy" if args.memory_stall_s is None else f"{args.memory_stall_s:g} s"
    restore = "2 x per-device shard / host copy" if args.memory_restore_s is None else f"{args.memory_restore_s:g} s"
    print(f"\nTwo tiers: goodput = useful time / wall time (model outputs). Device MTBF "
          f"{args.device_mtbf_hours:,.0f} h, {args.devices_per_node} devices/node; restart R={args.restart_s:.0f} s "
          f"plus the state read (storage: state / bandwidth; memory: {restore});\ndurable saves async at T* async; "
          f"memory snapshot stall {stall}, interval {args.memory_interval} (steps of {args.step_s:g} s)")
    sim = args.simulate
    head = (f"{'model':>5} {'storage':>8} {'devices':>8} {'nodes':>6} {'MTBF':>8} {'T dur':>7} {'T mem':>7} "
            f"{'P both':>8} {'lost dur':>9} {'lost 2t':>8} {'goodput dur':>11} {'2-tier':>7} {'gain':>8}"
            + (f" {'sim dur':>8} {'sim 2t':>7}" if sim else ""))
    print(head)
    print("-" * len(head))
    for r in rows:
        line = (f"{r['model']:>5} {r['storage_gbps']:>5g}GB/s {r['devices']:>8} {r['nodes']:>6} "
                f"{r['mtbf_s'] / 3600:>6.1f} h {r['durable'].durable_interval_s:>6.1f}s "
                f"{r['two'].memory_interval_s:>6.1f}s {r['p_both']:>8.1e} {r['lost_durable_s']:>8.0f}s "
                f"{r['lost_two_s']:>7.0f}s {r['goodput_durable']:>11.4f} {r['goodput_two']:>7.4f} "
                f"{100 * (r['goodput_two'] - r['goodput_durable']):>+6.2f}pp")
        if sim:
            line += f" {r['sim_durable']:>8.4f} {r['sim_two']:>7.4f}"
        print(line)


def plot(rows, args, out: Path) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    mtbf = cluster_mtbf_s(args.device_mtbf_hours, args.devices)
    written = []
    grid = [60 * m for m in (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240)]
    for name in args.models:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for bw in args.storage_gbps:
            _, c_sync, c_snap, write = costs(name, bw, args.devices, args)
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


def bad_options(args) -> list:
    """Each option that would make a wrong table, named with its value."""
    out = []
    positive = dict(devices=args.devices, devices_per_node=args.devices_per_node, step_s=args.step_s,
                    trials=args.trials, device_mtbf_hours=args.device_mtbf_hours, host_copy_gbps=args.host_copy_gbps,
                    bytes_per_param=args.bytes_per_param, seq_len=args.seq_len)
    for name, value in positive.items():
        if not (math.isfinite(value) and value > 0):
            out.append(f"--{name.replace('_', '-')}={value}: must be positive")
    for name in ("restart_s", "memory_stall_s", "memory_restore_s"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            out.append(f"--{name.replace('_', '-')}={value}: must be a non-negative number of seconds")
    out += [f"--scales {n}: a device count must be >= 1" for n in args.scales if n < 1]
    out += [f"--storage-gbps {bw}: must be positive" for bw in args.storage_gbps if not bw > 0]
    for devices in ([args.devices] if args.devices > 0 else []) + [n for n in args.scales if n >= 1]:
        out += [f"--devices/--scales {devices}: not a multiple of {m}'s tp {PROBE_TP[m]} (PROBE_TP)"
                for m in args.models if m in PROBE_TP and devices % PROBE_TP[m]]
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--storage-gbps", type=float, nargs="+", default=[1.0, 10.0, 100.0],
                   help="aggregate storage write bandwidth, GB/s")
    p.add_argument("--intervals-min", type=float, nargs="+", default=[5, 15, 30, 60])
    p.add_argument("--devices", type=int, default=1024)
    p.add_argument("--device-mtbf-hours", type=float, default=DEFAULT_DEVICE_MTBF_HOURS)
    p.add_argument("--host-copy-gbps", type=float, default=DEFAULT_HOST_COPY_GBPS,
                   help="device-to-host staging bandwidth per device (the planner's default)")
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence of the probe (4 sequences)")
    p.add_argument("--restart-s", type=float, default=300.0,
                   help="recovery time R (measured MTTR); the two-tier table adds the state read to it")
    p.add_argument("--bytes-per-param", type=float, default=12.0)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "plan_checkpointing")
    p.add_argument("--no-plots", action="store_true")
    two = p.add_argument_group("two tiers (durable + node-local memory with a peer replica)")
    two.add_argument("--scales", type=int, nargs="+", default=[1000, 10000, 100000], help="device counts")
    two.add_argument("--devices-per-node", type=int, default=8)
    two.add_argument("--step-s", type=float, default=1.0, help="training step time: snapshots are whole steps")
    two.add_argument("--memory-interval", type=memory_interval, default="auto",
                     help="steps between memory snapshots, or auto (Young/Daly on the snapshot stall)")
    two.add_argument("--memory-stall-s", type=float, default=None,
                     help="measured memory snapshot stall (default: the per-device shard / --host-copy-gbps)")
    two.add_argument("--memory-restore-s", type=float, default=None,
                     help="measured memory/peer restore time (default: twice the shard copy: peer, then device)")
    two.add_argument("--simulate", action="store_true", help="add the Monte Carlo of planner/simulate.py")
    two.add_argument("--trials", type=int, default=10)
    two.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> None:
    p = parser()
    args = p.parse_args(argv)
    for problem in bad_options(args):
        p.error(problem)
    rows = table(args)
    print_table(rows, args)
    print_two_tier(two_tier_table(args), args)
    if not args.no_plots:
        for path in plot(rows, args, args.out):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
