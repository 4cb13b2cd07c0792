"""The ``object`` tier on S3 (or any S3-compatible endpoint) through ``boto3``.

Objects are named ``<prefix><key hex>.kvc`` in ``bucket``. A put is one
``PutObject`` with ``If-None-Match: *``: S3 makes an object visible only once its
upload is complete, and the condition means an existing chunk is never
overwritten (chunks are immutable; a 412 or 409 answer means another writer got
there first, which is fine). moto 5 honours the condition too. A reader verifies
every object it downloads; a corrupt one is deleted and is a miss. Transport
checksums are requested only where S3 requires them: the chunk's own digests
already cover the bytes end to end, and skipping them spares a pass over the body.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from kvrelay.store.chunk_format import ChunkView, decode_whole_header
from kvrelay.store.files import CHUNK_SUFFIX, key_of_file_name
from kvrelay.store.tier import ChunkTier, CorruptionListener, ResidencyListener

log = logging.getLogger(__name__)

_ALREADY_EXISTS = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
_MISSING = {"NoSuchKey", "404", "NotFound"}


def _request_body(blob: Any) -> Any:
    """The ``PutObject`` body for a chunk buffer."""
    return blob if isinstance(blob, bytes) else bytes(blob)


def _error_code(err: Exception) -> str:
    response = getattr(err, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


class S3Tier(ChunkTier):
    """Chunks as objects ``<prefix><key hex>.kvc`` in an S3 bucket.

    ``client`` is a boto3 S3 client; ``make_client`` builds one for an endpoint.
    The bucket must exist (``create_bucket`` makes it, for tests and first use).
    """

    name = "object"
    durable = True

    def __init__(
        self,
        client: Any,
        bucket: str,
        prefix: str = "",
        on_residency: ResidencyListener | None = None,
        on_corrupt: CorruptionListener | None = None,
        verify_payload: bool = True,
    ) -> None:
        super().__init__(on_residency, on_corrupt, verify_payload)
        if len(bucket) < 3:
            raise ValueError(f"S3 bucket name {bucket!r} is too short: bucket names need 3 to 63 characters")
        self._client = client
        self.bucket = bucket
        self.prefix = prefix

    @staticmethod
    def make_client(
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
        max_pool_connections: int = 16,
    ) -> Any:
        """A boto3 S3 client for ``endpoint_url`` (None: AWS) with bounded timeouts."""
        import boto3
        from botocore.config import Config

        config = Config(
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"max_attempts": 3, "mode": "standard"},
            max_pool_connections=max_pool_connections,
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
        )
        return boto3.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)

    def create_bucket(self) -> None:
        """Create the bucket unless this account already owns it."""
        try:
            self._client.create_bucket(Bucket=self.bucket)
        except Exception as err:
            if _error_code(err) not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                raise

    def object_name(self, key: bytes) -> str:
        return f"{self.prefix}{key.hex()}{CHUNK_SUFFIX}"

    def put(self, blob: Any) -> bool:
        header = decode_whole_header(blob)
        size = header.total_len
        try:
            self._client.put_object(
                Bucket=self.bucket, Key=self.object_name(header.key), Body=_request_body(blob), IfNoneMatch="*"
            )
        except Exception as err:
            if _error_code(err) in _ALREADY_EXISTS:
                return False
            raise
        with self._lock:
            self._counters.add(bytes_written=size, chunks_written=1)
            self._emit((header.key,), (), "stored")
        return True

    def get(self, key: bytes, fingerprint: bytes | None = None) -> ChunkView | None:
        """The verified chunk; a missing object is a miss, and so is a failed or short download
        (logged and counted as an error, the object left in place)."""
        try:
            buffer = self._download(key)
        except Exception as err:
            if _error_code(err) in _MISSING:
                self._counters.add(misses=1)
                return None
            log.warning("S3 download of chunk %s from bucket %s failed: %s", key.hex(), self.bucket, err)
            self._counters.add(errors=1, misses=1)
            return None
        return self._served(buffer, key, fingerprint)

    def _download(self, key: bytes) -> bytearray:
        """The whole object, read into one preallocated buffer; raises on a short body."""
        response = self._client.get_object(Bucket=self.bucket, Key=self.object_name(key))
        length = int(response["ContentLength"])
        buffer = bytearray(length)
        view = memoryview(buffer)
        body = response["Body"]
        try:
            pos = 0
            while pos < length:
                piece = body.read(min(length - pos, 1 << 20))
                if not piece:
                    raise OSError(f"body ended after {pos} of {length} bytes")
                view[pos : pos + len(piece)] = piece
                pos += len(piece)
        finally:
            body.close()
        return buffer

    def contains(self, key: bytes) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self.object_name(key))
        except Exception as err:
            if _error_code(err) in _MISSING:
                return False
            raise
        return True

    def _names(self) -> Iterator[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
            for item in page.get("Contents", ()):
                yield item["Key"]

    def keys(self) -> list[bytes]:
        return [key for name in self._names() if (key := key_of_file_name(name[len(self.prefix) :])) is not None]

    def _delete(self, key: bytes) -> bool:
        if not self.contains(key):
            return False
        self._client.delete_object(Bucket=self.bucket, Key=self.object_name(key))
        return True
