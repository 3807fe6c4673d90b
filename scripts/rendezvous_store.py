"""A c10d rendezvous store of its own, so that losing any training node never ends the job.

With ``--rdzv-backend c10d`` the store that forms the group (and that the workers' process
groups bootstrap from) lives inside the torchrun agent whose host matches
``--rdzv-endpoint``: when that node is lost, every other agent loses the store and the job
ends (tests/integration/test_rendezvous_store.py measures both). Run this on a host that trains nothing
(a login or service node, a small CPU pod), point every agent's ``--rdzv-endpoint`` at it and
give them ``--rdzv-conf is_host=false``: then any training node may die and the survivors
re-form the group (with its replacement, or smaller within an elastic ``--nnodes MIN:MAX`` whose
every size runs the layout).

  python scripts/rendezvous_store.py --port 29400            # on the store host; runs until SIGTERM
  RDZV_HOST=store-host RDZV_IS_HOST=false NNODES=64 scripts/launch_multi_node.sh +experiment=70b
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import threading

import torch.distributed as dist


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=29400)
    args = parser.parse_args(argv)
    store = dist.TCPStore(args.host, args.port, is_master=True, wait_for_workers=False, multi_tenant=True,
                          timeout=datetime.timedelta(seconds=60))
    done = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: done.set())
    print(f"rendezvous store listening on {args.host}:{store.port}", flush=True)
    done.wait()
    print("rendezvous store: stopping", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
