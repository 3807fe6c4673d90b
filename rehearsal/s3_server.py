"""A real S3 endpoint for the tests and the S3 benchmark: moto's server on 127.0.0.1 (a random free
port), started and stopped by whoever needs it, holding its objects in memory (nothing left on disk).

``env`` is what a process needs to use it (boto3's endpoint and credential variables, and small
multipart parts so that a debug checkpoint's files are uploaded in several parts).

``delay_parts(seconds)`` makes the server hold every part upload that long before it answers (moto's
own app behind a small WSGI wrapper, this file run as a program): a test that must act while a
file is half uploaded gets a window it can see, instead of the milliseconds a local upload takes.
``delay_copies(seconds)`` does the same to every server-side copy (a PUT with ``x-amz-copy-source``),
which on a real store takes time in proportion to the object's size. ``delay_requests(seconds)`` holds
every request that long (a distant endpoint's round trip, where a listing of many folders adds up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, Optional

from rehearsal.processes import free_port, kill_tree, wait_listening

BUCKET = "checkpoints"
PART_BYTES = 256 << 10  # the tests' multipart part size (S3's floor is 5 MiB; moto's is lowered to match)


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
        fd, self.delay_file = tempfile.mkstemp(prefix="s3-delays-")
        os.close(fd)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(self.port), self.delay_file],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        wait_listening(self.proc, self.port, "moto's S3 server", timeout_s)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait()
        self.proc = None
        if getattr(self, "delay_file", None):
            os.unlink(self.delay_file)
            self.delay_file = None

    def delay_parts(self, seconds: float) -> None:
        """From now on the server holds each part upload ``seconds`` before it answers (0: at once)."""
        self._delay("part", seconds)

    def delay_copies(self, seconds: float) -> None:
        """From now on the server holds each server-side copy ``seconds`` before it answers (0: at once)."""
        self._delay("copy", seconds)

    def delay_requests(self, seconds: float) -> None:
        """From now on the server holds every request ``seconds`` before it answers (0: at once), on top of
        the delays above."""
        self._delay("request", seconds)

    def _delay(self, kind: str, seconds: float) -> None:
        with open(self.delay_file) as f:
            delays = json.loads(f.read() or "{}")
        with open(self.delay_file, "w") as f:
            f.write(json.dumps({**delays, kind: seconds}))

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="test", aws_secret_access_key="test",
                            region_name="us-east-1")

    def make_bucket(self, name: str = BUCKET) -> str:
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"


def _serve(port: int, delay_file: str) -> None:
    """moto's S3 app on 127.0.0.1:``port``; a part upload (PUT ...?partNumber=N&uploadId=...) and a copy
    (PUT with x-amz-copy-source) wait the seconds ``delay_file`` gives for their kind first, and every
    request the seconds it gives for "request"."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    os.environ.setdefault("MOTO_PORT", str(port))  # as python -m moto.server sets it
    app = DomainDispatcherApplication(create_backend_app)

    def held(environ, start_response):
        kind = ("copy" if "HTTP_X_AMZ_COPY_SOURCE" in environ
                else "part" if "partNumber=" in environ.get("QUERY_STRING", "") else None)
        try:
            with open(delay_file) as f:
                delays = json.loads(f.read() or "{}")
        except (OSError, ValueError):
            delays = {}
        wait = float(delays.get("request", 0))
        if environ.get("REQUEST_METHOD") == "PUT" and kind is not None:
            wait += float(delays.get(kind, 0))
        time.sleep(wait)
        return app(environ, start_response)

    run_simple("127.0.0.1", port, held, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2])
