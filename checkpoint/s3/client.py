"""One boto3 S3 client per process, and the store's errors as the OSErrors the durable tier handles.

boto3 because it is the reference SDK: synchronous (the saver and loader already run their I/O
on threads, and botocore releases the GIL while it waits on the network), thread-safe clients,
and every call this tier needs (conditional PUT with ``If-None-Match``, multipart uploads,
ranged GETs, listing uploads left open). The endpoint and credentials come from boto3's own
settings: ``AWS_ENDPOINT_URL_S3`` (or ``AWS_ENDPOINT_URL``) for an S3-compatible store,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_REGION``, or a profile.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Callable, Optional, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_client = None
_client_key: Optional[tuple] = None

# S3 error codes -> errno: a missing object is FileNotFoundError, a refused conditional write
# FileExistsError, a refusal of access PermissionError; the rest is the storage failing (EIO)
_CODES = {
    "NoSuchKey": errno.ENOENT, "404": errno.ENOENT, "NotFound": errno.ENOENT, "NoSuchBucket": errno.ENOENT,
    "NoSuchUpload": errno.ENOENT,
    "PreconditionFailed": errno.EEXIST, "412": errno.EEXIST, "ConditionalRequestConflict": errno.EEXIST,
    "AccessDenied": errno.EACCES, "403": errno.EACCES, "InvalidAccessKeyId": errno.EACCES,
    "SignatureDoesNotMatch": errno.EACCES, "QuotaExceeded": errno.EDQUOT,
}


def client():
    """This process's client, made again after a fork (a client must not cross one) or when the
    endpoint or credentials in the environment changed."""
    global _client, _client_key
    key = (os.getpid(), *(os.environ.get(k) for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                                        "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION")))
    with _lock:
        if _client is None or _client_key != key:
            import boto3
            from botocore.config import Config

            config = Config(retries={"max_attempts": int(os.environ.get("LLM_S3_MAX_ATTEMPTS", "5")),
                                     "mode": "standard"},
                            connect_timeout=float(os.environ.get("LLM_S3_CONNECT_TIMEOUT_S", "10")),
                            read_timeout=float(os.environ.get("LLM_S3_READ_TIMEOUT_S", "60")),
                            max_pool_connections=32)
            _client, _client_key = boto3.session.Session().client("s3", config=config), key
        return _client


def as_oserror(exc: BaseException, what: str) -> OSError:
    """The OSError the durable tier understands for a botocore failure of ``what`` (an s3:// URL)."""
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
