"""S3 and S3-compatible object stores (``checkpoint.dir=s3://bucket/prefix``) as a store, through boto3
(docs/checkpoint-format.md says why, and which settings and environment variables apply).

A folder is a key prefix: it exists while an object lies under it. A file is a multipart upload (S3
wants parts of at least 5 MiB but for the last), up to IN_FLIGHT parts at once, visible only when it
completes; an upload that fails is aborted, and one a killed writer left open is aborted by
``abort_unfinished`` at the next start. ``configure`` puts checkpoint.s3's values in this process's
environment, so DCP's writer processes (``async_process``, started by spawn: they inherit the
environment, not this module's state) use the same store.
"""

from __future__ import annotations

import errno
import io
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, TypeVar

from checkpoint.storage.base import Entry, Store
from checkpoint.storage.s3.config import ADDRESSING_VAR, ENDPOINT_VAR, REGION_VAR, configure

T = TypeVar("T")
SCHEME = "s3://"
DEFAULT_PART_BYTES = 64 << 20
IN_FLIGHT = 4  # parts uploading at once per file (each its own connection)

# S3 error codes -> errno: a missing object is FileNotFoundError, a refused conditional write
# FileExistsError, a refusal of access PermissionError; the rest is the storage failing (EIO)
_CODES = {
    "NoSuchKey": errno.ENOENT, "404": errno.ENOENT, "NotFound": errno.ENOENT, "NoSuchBucket": errno.ENOENT,
    "NoSuchUpload": errno.ENOENT,
    "PreconditionFailed": errno.EEXIST, "412": errno.EEXIST, "ConditionalRequestConflict": errno.EEXIST,
    "AccessDenied": errno.EACCES, "403": errno.EACCES, "InvalidAccessKeyId": errno.EACCES,
    "SignatureDoesNotMatch": errno.EACCES, "QuotaExceeded": errno.EDQUOT,
}


_lock = threading.Lock()
_client = None
_client_key: Optional[tuple] = None


def client():
    """This process's client, made again after a fork (a client must not cross one) or when the
    endpoint or credentials in the environment changed."""
    global _client, _client_key
    key = (os.getpid(), *(os.environ.get(k) for k in (ENDPOINT_VAR, REGION_VAR, ADDRESSING_VAR, "AWS_ENDPOINT_URL_S3",
                                                        "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_PROFILE",
                                                        "AWS_REGION", "AWS_DEFAULT_REGION")))
    with _lock:
        if _client is None or _client_key != key:
            import boto3
            from botocore.config import Config

            config = Config(retries={"max_attempts": int(os.environ.get("LLM_S3_MAX_ATTEMPTS", "5")),
                                     "mode": "standard"},
                            connect_timeout=float(os.environ.get("LLM_S3_CONNECT_TIMEOUT_S", "10")),
                            read_timeout=float(os.environ.get("LLM_S3_READ_TIMEOUT_S", "60")),
                            max_pool_connections=32,
                            s3={"addressing_style": os.environ.get(ADDRESSING_VAR, "auto")})
            where = {k: v for k, v in (("endpoint_url", os.environ.get(ENDPOINT_VAR)),
                                       ("region_name", os.environ.get(REGION_VAR))) if v}
            _client, _client_key = boto3.session.Session().client("s3", config=config, **where), key
        return _client


def as_oserror(exc: BaseException, what: str) -> OSError:
    """The OSError the checkpoint code understands for a botocore failure of ``what`` (an s3:// URL)."""
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        number = _CODES.get(code, _CODES.get(status, errno.EIO))
        cls = {errno.ENOENT: FileNotFoundError, errno.EEXIST: FileExistsError,
               errno.EACCES: PermissionError}.get(number, OSError)
        return cls(number, f"S3 {code or status}: {err.get('Message', exc)}", what)
    return OSError(errno.EIO, f"S3 endpoint unreachable or failing ({type(exc).__name__}: {exc})", what)


def call(what: str, fn: Callable[..., T], **kwargs) -> T:
    """``fn(**kwargs)`` (a client method), its botocore failures raised as OSErrors naming ``what``."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(**kwargs)
    except (ClientError, BotoCoreError) as exc:
        raise as_oserror(exc, what) from exc


def _pages(what: str, **kwargs) -> List[dict]:
    """Every page of a ``list_objects_v2`` (its failures, raised while paging, as OSErrors)."""
    try:
        return list(client().get_paginator("list_objects_v2").paginate(**kwargs))
    except Exception as exc:  # botocore's
        raise as_oserror(exc, what) from exc


# -- a file written as a multipart upload, and read by ranged GETs --------------------------------------
def part_bytes() -> int:
    return int(os.environ.get("LLM_S3_PART_BYTES", DEFAULT_PART_BYTES))


class MultipartWriter:
    """``write`` buffers up to one part and uploads it; ``close`` completes the object (one PUT
    when it fits in one part); ``abort`` deletes the parts sent, nothing becomes visible."""

    def __init__(self, bucket: str, key: str):
        self.bucket, self.key, self.url = bucket, key, f"{SCHEME}{bucket}/{key}"
        self._buffer = bytearray()
        self._part = part_bytes()
        self._upload_id: Optional[str] = None
        self._sent: List[Future] = []  # the parts' uploads, in part order
        self._pool: Optional[ThreadPoolExecutor] = None
        self._closed = False
        self._size = 0

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        self._buffer += mv
        self._size += len(mv)
        while len(self._buffer) >= self._part:
            self._send(bytes(self._buffer[:self._part]))
            del self._buffer[:self._part]
        return len(mv)

    def flush(self) -> None:
        pass

    def tell(self) -> int:
        return self._size

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
        try:
            if self._upload_id is None:
                call(self.url, c.put_object, Bucket=self.bucket, Key=self.key, Body=bytes(self._buffer))
                return
            if self._buffer:
                self._send(bytes(self._buffer))
            parts = [f.result() for f in self._sent]
            call(self.url, c.complete_multipart_upload, Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                 MultipartUpload={"Parts": parts})
        except BaseException:
            self.abort()
            raise
        finally:
            self._buffer = bytearray()
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def abort(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._upload_id is not None:
            try:
                call(self.url, client().abort_multipart_upload, Bucket=self.bucket, Key=self.key,
                     UploadId=self._upload_id)
            except OSError:
                pass  # the next start aborts uploads left open (abort_unfinished)
            self._upload_id = None

    def __enter__(self) -> "MultipartWriter":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.close() if kind is None else self.abort()


class RangedReader(io.RawIOBase):
    """``seek`` moves a position; ``readinto`` GETs exactly the bytes it fills from there."""

    def __init__(self, bucket: str, key: str):
        self.bucket, self.key, self.url = bucket, key, f"{SCHEME}{bucket}/{key}"
        self._pos = 0
        self._size: Optional[int] = None

    def _length(self) -> int:
        if self._size is None:
            self._size = int(call(self.url, client().head_object, Bucket=self.bucket, Key=self.key)["ContentLength"])
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self._length() + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def _get(self, **ranged) -> bytes:
        body = call(self.url, client().get_object, Bucket=self.bucket, Key=self.key, **ranged)["Body"]
        try:
            return body.read()
        except Exception as exc:  # the connection broke while streaming the body
            raise OSError(errno.EIO, f"S3 read of {self.url} broke off: {exc}", self.url) from exc

    def readinto(self, buffer) -> int:
        mv = memoryview(buffer).cast("B")
        if not len(mv) or self._pos >= self._length():
            return 0
        end = min(self._pos + len(mv), self._length()) - 1
        data = self._get(Range=f"bytes={self._pos}-{end}")
        mv[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def readall(self) -> bytes:
        if self._pos == 0 and self._size is None:  # a whole file (a manifest, a marker): one GET, no HEAD first
            data = self._get()
            self._size = self._pos = len(data)
            return data
        buf = bytearray(max(0, self._length() - self._pos))
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = self.readinto(view[got:])
            if not n:
                break
            got += n
        return bytes(buf[:got])


# -- the store ---------------------------------------------------------------------------------------
class S3Store(Store):
    """The objects of one bucket; keys are object keys (a folder key has no trailing slash)."""

    _stores: Dict[str, "S3Store"] = {}

    def __init__(self, bucket: str):
        self.bucket = bucket

    @classmethod
    def parse(cls, url: str):
        """(store, key) of an ``s3://bucket/prefix`` URL."""
        bucket, _, key = str(url)[len(SCHEME):].partition("/")
        if not bucket:
            raise ValueError(f"{url!r} names no bucket (s3://bucket/prefix)")
        return cls._stores.setdefault(bucket, cls(bucket)), key.strip("/")

    @classmethod
    def configure(cls, settings) -> None:
        s3 = settings.s3
        configure(s3.endpoint_url, s3.region, s3.addressing_style)

    def url(self, key: str) -> str:
        return f"{SCHEME}{self.bucket}/{key}" if key else f"{SCHEME}{self.bucket}"

    @staticmethod
    def _prefix(key: str) -> str:
        return f"{key}/" if key else ""

    def list(self, key: str) -> List[Entry]:
        prefix, out = self._prefix(key), []
        try:
            pages = _pages(self.url(key), Bucket=self.bucket, Prefix=prefix, Delimiter="/")
        except FileNotFoundError:  # NoSuchBucket
            return []
        for page in pages:
            out += [Entry(p["Prefix"][len(prefix):].rstrip("/"), is_dir=True) for p in page.get("CommonPrefixes", [])]
            out += [Entry(o["Key"][len(prefix):], int(o["Size"]), o["LastModified"].timestamp())
                    for o in page.get("Contents", []) if o["Key"] != prefix]
        return out

    def walk(self, key: str) -> List[Entry]:
        prefix = self._prefix(key)
        return [Entry(o["Key"][len(prefix):], int(o["Size"]), o["LastModified"].timestamp())
                for page in _pages(self.url(key), Bucket=self.bucket, Prefix=prefix) for o in page.get("Contents", [])]

    def stat(self, key: str) -> Optional[Entry]:
        if not key:
            return None
        try:
            head = call(self.url(key), client().head_object, Bucket=self.bucket, Key=key)
        except FileNotFoundError:
            return None
        return Entry(key.rsplit("/", 1)[-1], int(head["ContentLength"]), head["LastModified"].timestamp())

    def _bucket_exists(self) -> bool:
        try:
            call(self.url(""), client().head_bucket, Bucket=self.bucket)
            return True
        except FileNotFoundError:
            return False

    def is_dir(self, key: str) -> bool:
        """An object lies under this prefix (or it is an existing bucket); False in a missing bucket."""
        try:
            listed = call(self.url(key), client().list_objects_v2, Bucket=self.bucket, Prefix=self._prefix(key),
                          MaxKeys=1)
        except FileNotFoundError:  # NoSuchBucket
            return False
        return listed.get("KeyCount", 0) > 0 or (not key and self._bucket_exists())

    def open_read(self, key: str) -> RangedReader:
        return RangedReader(self.bucket, key)

    def open_write(self, key: str) -> MultipartWriter:
        return MultipartWriter(self.bucket, key)

    def write(self, key: str, data: bytes) -> None:
        call(self.url(key), client().put_object, Bucket=self.bucket, Key=key, Body=data)

    def create(self, key: str, data: bytes) -> None:
        """A conditional PUT (If-None-Match). The client retries a PUT whose answer it lost (a dropped connection,
        a read timeout), and the retry meets the object the first try created: a refusal after a retry is this
        writer's own create when the object holds ``data`` (a manifest, a lease record: unique to its writer)."""
        try:
            call(self.url(key), client().put_object, Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
        except FileExistsError as exc:
            retried = getattr(exc.__cause__, "response", {}).get("ResponseMetadata", {}).get("RetryAttempts", 0)
            if not retried or self.open_read(key).readall() != data:
                raise

    def delete(self, key: str) -> None:
        call(self.url(key), client().delete_object, Bucket=self.bucket, Key=key)

    def delete_tree(self, key: str) -> None:
        """Every object under the prefix, 1,000 per request."""
        prefix = self._prefix(key)
        keys = [prefix + e.name for e in self.walk(key)]
        for i in range(0, len(keys), 1000):
            call(self.url(key), client().delete_objects, Bucket=self.bucket,
                 Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})

    def prepare(self, key: str) -> None:
        """Prefixes need no creation; the bucket must exist (made by whoever owns the store)."""
        if not self._bucket_exists():
            raise FileNotFoundError(errno.ENOENT, f"bucket {self.bucket!r} does not exist: create it, or point "
                                                  "checkpoint.dir at an existing bucket", self.url(key))

    def failure_hint(self):
        return ("the object store failed or did not answer",
                "check the endpoint (checkpoint.s3.endpoint_url, else AWS_ENDPOINT_URL_S3), the credentials "
                "and the bucket")

    def abort_unfinished(self, key: str) -> List[str]:
        """Abort the multipart uploads left open under the prefix (a killed writer's parts, which the store
        keeps and bills until aborted); their keys."""
        c, aborted = client(), []
        listed = call(self.url(key), c.list_multipart_uploads, Bucket=self.bucket, Prefix=self._prefix(key))
        for up in listed.get("Uploads", []):
            call(self.url(key), c.abort_multipart_upload, Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
            aborted.append(up["Key"])
        return aborted
