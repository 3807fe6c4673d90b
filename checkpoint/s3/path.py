"""``S3Path``: the part of pathlib the durable tier uses, over the objects of a bucket.

A "directory" is a key prefix: it exists while an object lies under it and needs no creation.
There is no rename: checkpoint/durable/commit.py commits an S3 checkpoint by writing its
manifest last, with ``If-None-Match: *``, and the few places that would move a directory copy
its objects on the server and delete them (``copy_tree``), which only forensic names need.
``S3Path`` has no ``__fspath__``, so a local-file call given one fails loudly instead of writing
into a local folder named ``s3:``.
"""

from __future__ import annotations

import fnmatch
import io
from dataclasses import dataclass
from typing import Iterator, List

from checkpoint.s3.client import call, client
from checkpoint.s3.streams import MultipartWriter, RangedReader

SCHEME = "s3://"


def is_s3(location) -> bool:
    return isinstance(location, S3Path) or str(location).startswith(SCHEME)


@dataclass(frozen=True)
class S3Stat:
    st_size: int
    st_mtime: float


class S3Path:
    def __init__(self, url: str):
        url = str(url)
        if not url.startswith(SCHEME):
            raise ValueError(f"{url!r} is not an s3:// URL (s3://bucket/prefix)")
        bucket, _, key = url[len(SCHEME):].partition("/")
        if not bucket:
            raise ValueError(f"{url!r} names no bucket (s3://bucket/prefix)")
        self.bucket, self.key = bucket, key.strip("/")

    # -- names ---------------------------------------------------------------------------------
    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}" if self.key else f"{SCHEME}{self.bucket}"

    def __repr__(self) -> str:
        return f"S3Path({str(self)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, S3Path) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other: "S3Path") -> bool:
        return str(self) < str(other)

    def __truediv__(self, name) -> "S3Path":
        name = str(name).strip("/")
        return S3Path(f"{self}/{name}") if name else self

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "S3Path":
        return S3Path(f"{SCHEME}{self.bucket}/{self.key.rsplit('/', 1)[0] if '/' in self.key else ''}")

    def resolve(self) -> "S3Path":
        return self  # already absolute: a bucket and a key

    def with_name(self, name: str) -> "S3Path":
        return self.parent / name

    @property
    def _prefix(self) -> str:
        return f"{self.key}/" if self.key else ""

    # -- queries -------------------------------------------------------------------------------
    def stat(self) -> S3Stat:
        head = call(str(self), client().head_object, Bucket=self.bucket, Key=self.key)
        return S3Stat(int(head["ContentLength"]), head["LastModified"].timestamp())

    def is_file(self) -> bool:
        if not self.key:
            return False
        try:
            self.stat()
            return True
        except FileNotFoundError:
            return False

    def is_dir(self) -> bool:
        """An object lies under this prefix (or it is an existing bucket); False in a missing bucket,
        as pathlib answers for a missing folder (the pre-flight's mkdir names the bucket)."""
        try:
            listed = call(str(self), client().list_objects_v2, Bucket=self.bucket, Prefix=self._prefix, MaxKeys=1)
        except FileNotFoundError:  # NoSuchBucket
            return False
        return listed.get("KeyCount", 0) > 0 or (not self.key and self._bucket_exists())

    def _bucket_exists(self) -> bool:
        try:
            call(str(self), client().head_bucket, Bucket=self.bucket)
            return True
        except FileNotFoundError:
            return False

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def iterdir(self) -> Iterator["S3Path"]:
        """The objects and prefixes directly under this one."""
        pages = client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._prefix,
                                                                   Delimiter="/")
        found: List[S3Path] = []
        try:
            for page in pages:
                found += [self / p["Prefix"][len(self._prefix):] for p in page.get("CommonPrefixes", [])]
                found += [self / o["Key"][len(self._prefix):] for o in page.get("Contents", [])
                          if o["Key"] != self._prefix]
        except Exception as exc:  # botocore's, raised while paging
            from checkpoint.s3.client import as_oserror
            raise as_oserror(exc, str(self)) from exc
        return iter(found)

    def glob(self, pattern: str) -> Iterator["S3Path"]:
        if "/" in pattern or "**" in pattern:
            raise ValueError(f"S3Path.glob({pattern!r}): only a pattern of names directly under {self}")
        return iter([p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern)])

    def rglob(self, pattern: str) -> Iterator["S3Path"]:
        """Every object under this prefix, at any depth (only the pattern ``*``)."""
        if pattern != "*":
            raise ValueError(f"S3Path.rglob({pattern!r}): only '*'")
        return iter([S3Path(f"{SCHEME}{self.bucket}/{k}") for k in self.keys()])

    def keys(self) -> List[str]:
        """Every object key under this prefix, at any depth."""
        out: List[str] = []
        try:
            for page in client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._prefix):
                out += [o["Key"] for o in page.get("Contents", [])]
        except Exception as exc:
            from checkpoint.s3.client import as_oserror
            raise as_oserror(exc, str(self)) from exc
        return out

    # -- content -------------------------------------------------------------------------------
    def read_bytes(self) -> bytes:
        return call(str(self), client().get_object, Bucket=self.bucket, Key=self.key)["Body"].read()

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes, exclusive: bool = False) -> int:
        """One PUT; ``exclusive``: only if the object does not exist (else FileExistsError)."""
        condition = {"IfNoneMatch": "*"} if exclusive else {}
        call(str(self), client().put_object, Bucket=self.bucket, Key=self.key, Body=bytes(data), **condition)
        return len(data)

    def write_text(self, text: str, encoding: str = "utf-8", exclusive: bool = False) -> int:
        return self.write_bytes(text.encode(encoding), exclusive=exclusive)

    def open(self, mode: str = "rb", buffering: int = -1, exclusive: bool = False):
        if mode == "rb":
            return RangedReader(self.bucket, self.key)
        if mode == "wb":
            return MultipartWriter(self.bucket, self.key, exclusive=exclusive)
        if mode == "r":
            return io.StringIO(self.read_text())
        raise ValueError(f"S3Path.open: mode {mode!r} (use rb, wb or r)")

    def touch(self) -> None:
        """Renew the object's modification time (its content rewritten): a heartbeat."""
        self.write_bytes(self.read_bytes() if self.is_file() else b"")

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Prefixes need no creation; the bucket must exist (made by whoever owns the store)."""
        if not self._bucket_exists():
            raise FileNotFoundError(2, f"bucket {self.bucket!r} does not exist: create it, or point "
                                       "checkpoint.dir at an existing bucket", str(self))

    def unlink(self, missing_ok: bool = False) -> None:
        if not missing_ok and not self.is_file():
            raise FileNotFoundError(2, "no such object", str(self))
        call(str(self), client().delete_object, Bucket=self.bucket, Key=self.key)

    # -- trees ---------------------------------------------------------------------------------
    def rmtree(self) -> None:
        """Delete every object under this prefix (deletions of 1,000 at a time)."""
        keys = self.keys()
        for i in range(0, len(keys), 1000):
            call(str(self), client().delete_objects, Bucket=self.bucket,
                 Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})

    def copy_tree(self, target: "S3Path") -> None:
        """Copy every object under this prefix to ``target`` on the server (no bytes through here)."""
        c = client()
        for key in self.keys():
            call(str(self), c.copy_object, Bucket=target.bucket, Key=target._prefix + key[len(self._prefix):],
                 CopySource={"Bucket": self.bucket, "Key": key})

    def abort_uploads(self) -> List[str]:
        """Abort the multipart uploads left open under this prefix (a killed writer's parts, which
        the store keeps and bills until aborted). Returns their keys."""
        c, aborted = client(), []
        listed = call(str(self), c.list_multipart_uploads, Bucket=self.bucket, Prefix=self._prefix)
        for up in listed.get("Uploads", []):
            call(str(self), c.abort_multipart_upload, Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
            aborted.append(up["Key"])
        return aborted
