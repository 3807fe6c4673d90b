"""An object written as a file (a multipart upload) and read as one (ranged GETs).

The durable tier's writer and reader (checkpoint/durable/writer.py, reader.py, segments.py)
write and read files with ``write``, ``seek`` and ``readinto``; these two classes give them that
over S3, so a checkpoint's bytes and the segment planning are the same on a disk and in a bucket.
A rank's data file is uploaded in parts as it is written (``LLM_S3_PART_BYTES``, default 64 MiB;
S3 wants at least 5 MiB but for the last), up to IN_FLIGHT parts at once, and becomes visible
only when the upload completes; an upload that fails is aborted, and one left open by a killed
writer is aborted at the next start (checkpoint/s3/path.py ``abort_uploads``). A read asks for
exactly the byte range it fills.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Optional

from checkpoint.s3.client import call, client

DEFAULT_PART_BYTES = 64 << 20
IN_FLIGHT = 4  # parts uploading at once per file (each its own connection)


def part_bytes() -> int:
    return int(os.environ.get("LLM_S3_PART_BYTES", DEFAULT_PART_BYTES))


class MultipartWriter:
    """``write`` buffers up to one part and uploads it; ``close`` completes the object (one PUT
    when it fits in one part). ``exclusive``: the object must not exist yet (``If-None-Match: *``)."""

    def __init__(self, bucket: str, key: str, exclusive: bool = False):
        self.bucket, self.key, self.exclusive = bucket, key, exclusive
        self.url = f"s3://{bucket}/{key}"
        self._buffer = bytearray()
        self._part = part_bytes()
        self._upload_id: Optional[str] = None
        self._sent: List[Future] = []  # the parts' uploads, in part order
        self._pool: Optional[ThreadPoolExecutor] = None
        self._closed = False
        self.size = 0

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        self._buffer += mv
        self.size += len(mv)
        while len(self._buffer) >= self._part:
            self._send(bytes(self._buffer[:self._part]))
            del self._buffer[:self._part]
        return len(mv)

    def flush(self) -> None:
        pass

    def _send(self, body: bytes) -> None:
        """Queue one part; at most IN_FLIGHT parts are uploading (and held in memory) at a time."""
        if self._upload_id is None:
            self._upload_id = call(self.url, client().create_multipart_upload, Bucket=self.bucket,
                                   Key=self.key)["UploadId"]
            self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="s3-upload")
        if len(self._sent) >= IN_FLIGHT:
            self._sent[-IN_FLIGHT].result()  # raises that part's failure here
        number = len(self._sent) + 1
        self._sent.append(self._pool.submit(self._upload, number, body))

    def _upload(self, number: int, body: bytes) -> dict:
        etag = call(self.url, client().upload_part, Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                    PartNumber=number, Body=body)["ETag"]
        return {"ETag": etag, "PartNumber": number}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        c = client()
        condition = {"IfNoneMatch": "*"} if self.exclusive else {}
        try:
            if self._upload_id is None:
                call(self.url, c.put_object, Bucket=self.bucket, Key=self.key, Body=bytes(self._buffer), **condition)
                return
            if self._buffer:
                self._send(bytes(self._buffer))
            parts = [f.result() for f in self._sent]
            call(self.url, c.complete_multipart_upload, Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                 MultipartUpload={"Parts": parts}, **condition)
        except BaseException:
            self.abort()
            raise
        finally:
            self._buffer = bytearray()
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def abort(self) -> None:
        """Give up: the parts uploaded so far are deleted, nothing becomes visible."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._upload_id is not None:
            try:
                call(self.url, client().abort_multipart_upload, Bucket=self.bucket, Key=self.key,
                     UploadId=self._upload_id)
            except OSError:
                pass  # the next start aborts uploads left open (S3Path.abort_uploads)
            self._upload_id = None

    def __enter__(self) -> "MultipartWriter":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


class RangedReader:
    """``seek`` moves a position; ``readinto`` GETs exactly the bytes it fills from there."""

    def __init__(self, bucket: str, key: str):
        self.bucket, self.key = bucket, key
        self.url = f"s3://{bucket}/{key}"
        self._pos = 0
        self._size: Optional[int] = None

    def _length(self) -> int:
        if self._size is None:
            self._size = int(call(self.url, client().head_object, Bucket=self.bucket, Key=self.key)["ContentLength"])
        return self._size

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self._length() + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def _get(self, n: int) -> bytes:
        if n <= 0 or self._pos >= self._length():
            return b""
        end = min(self._pos + n, self._length()) - 1
        body = call(self.url, client().get_object, Bucket=self.bucket, Key=self.key,
                    Range=f"bytes={self._pos}-{end}")["Body"]
        try:
            data = body.read()
        except Exception as exc:  # the connection broke while streaming the body
            raise OSError(5, f"S3 read of {self.url} broke off: {exc}", self.url) from exc
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        mv = memoryview(buffer).cast("B")
        data = self._get(len(mv))
        mv[:len(data)] = data
        return len(data)

    def read(self, n: int = -1) -> bytes:
        return self._get(self._length() - self._pos if n is None or n < 0 else n)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def __enter__(self) -> "RangedReader":
        return self

    def __exit__(self, *exc) -> None:
        pass
