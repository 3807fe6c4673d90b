"""A real S3 endpoint for the tests and the S3 benchmark: moto's server on 127.0.0.1 (a random free
port), started and stopped by whoever needs it, holding its objects in memory (nothing left on disk).

``env`` is what a process needs to use it (boto3's endpoint and credential variables, and small
multipart parts so that a debug checkpoint's files are uploaded in several parts)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, Optional

BUCKET = "checkpoints"
PART_BYTES = 256 << 10  # the tests' multipart part size (S3's floor is 5 MiB; moto's is lowered to match)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, port: Optional[int] = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self.env: Dict[str, str] = {
            "AWS_ENDPOINT_URL_S3": self.url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1", "LLM_S3_PART_BYTES": str(PART_BYTES),
            "LLM_S3_MAX_ATTEMPTS": "2", "LLM_S3_CONNECT_TIMEOUT_S": "2", "LLM_S3_READ_TIMEOUT_S": "20",
            "NO_PROXY": "127.0.0.1,localhost",
        }

    def start(self, timeout_s: float = 60) -> "S3Server":
        env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(PART_BYTES), "MOTO_ALLOW_NONEXISTENT_REGION": "true"}
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start on {self.url} (exit {self.proc.poll()})")
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="test", aws_secret_access_key="test",
                            region_name="us-east-1")

    def make_bucket(self, name: str = BUCKET) -> str:
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"
