"""Checkpoint save and load throughput on S3, next to the server's own raw PUT and GET of the
same bytes, measured in the same run against a local S3 server (moto's, on 127.0.0.1).

    python scripts/bench_s3.py --mib 256 --files 2

The state is ``--files`` ranks' worth of float32 tensors written as one process would write
``--files`` rank files (DCP with ``RawFileWriter`` to ``s3://bench/ckpt``; the commit adds a few
small objects and is not timed), then loaded back with ``RawFileReader`` (checksums verified).
The floors: boto3's own ``put_object`` / ``get_object`` of one object of the same size per file,
one request each, and its managed transfer (``upload_fileobj`` / ``download_fileobj``, parts in
parallel threads) at the same part size. Ratios are ours / floor (time), so 1.0 is the floor.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from checkpoint.durable.integrity import default_algorithm  # noqa: E402
from checkpoint.durable.reader import RawFileReader  # noqa: E402
from checkpoint.durable.writer import RawFileWriter  # noqa: E402
from checkpoint.s3.path import S3Path  # noqa: E402
from rehearsal.s3_server import S3Server  # noqa: E402


def _timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="state size in MiB")
    p.add_argument("--files", type=int, default=1, help="rank files the state is split into (one writer)")
    p.add_argument("--part-mib", type=int, default=64, help="multipart part size (LLM_S3_PART_BYTES)")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    if a.mib < 1 or a.files < 1 or a.part_mib < 5 or a.repeat < 1:
        p.error("--mib, --files, --repeat must be >= 1 and --part-mib >= 5 (S3's smallest part)")
    server = S3Server().start()
    os.environ.update(server.env)
    os.environ["LLM_S3_PART_BYTES"] = str(a.part_mib << 20)
    try:
        server.make_bucket("bench")
        c = server.client()
        n = (a.mib << 20) // 4 // a.files
        torch.manual_seed(0)
        state = {f"rank{r}": torch.randn(n) for r in range(a.files)}
        size = sum(t.numel() * 4 for t in state.values())
        blobs = [t.numpy().tobytes() for t in state.values()]
        from boto3.s3.transfer import TransferConfig

        managed = TransferConfig(multipart_threshold=a.part_mib << 20, multipart_chunksize=a.part_mib << 20)
        put = _timed(lambda: [c.put_object(Bucket="bench", Key=f"raw/{i}", Body=b) for i, b in enumerate(blobs)],
                     a.repeat)
        get = _timed(lambda: [c.get_object(Bucket="bench", Key=f"raw/{i}")["Body"].read()
                              for i in range(len(blobs))], a.repeat)
        mput = _timed(lambda: [c.upload_fileobj(io.BytesIO(b), "bench", f"managed/{i}", Config=managed)
                               for i, b in enumerate(blobs)], a.repeat)
        mget = _timed(lambda: [c.download_fileobj("bench", f"managed/{i}", io.BytesIO(), Config=managed)
                               for i in range(len(blobs))], a.repeat)
        root = S3Path("s3://bench/ckpt")

        def save():
            writer = RawFileWriter(str(root), default_algorithm())
            dcp.save(state, storage_writer=writer, no_dist=True)
            return writer

        written = {}
        save_s = _timed(lambda: written.update(save().written), a.repeat)
        target = {k: torch.empty_like(v) for k, v in state.items()}
        load_s = _timed(lambda: dcp.load(target, storage_reader=RawFileReader(
            str(root), verify=written, algorithm=default_algorithm()), no_dist=True), a.repeat)
        assert all(torch.equal(target[k], state[k]) for k in state), "the load did not return the saved bytes"
        gib = size / 2**30
        print(f"state {size / 2**20:.0f} MiB in {a.files} file(s), parts of {a.part_mib} MiB, median of {a.repeat}, "
              f"load average {os.getloadavg()[0]:.1f}")
        print(f"{'':24}{'seconds':>9}{'GiB/s':>8}{'/ one PUT or GET':>18}{'/ managed transfer':>20}")
        for name, t, one, many in (("save (RawFileWriter)", save_s, put, mput), ("load (RawFileReader)", load_s, get,
                                                                                 mget)):
            print(f"{name:24}{t:9.3f}{gib / t:8.2f}{t / one:17.2f}x{t / many:19.2f}x")
        for name, t in (("raw PUT, one request", put), ("raw GET, one request", get),
                        ("managed upload", mput), ("managed download", mget)):
            print(f"{name:24}{t:9.3f}{gib / t:8.2f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
