"""The shared secret that workers present to the router in the WebSocket handshake.

Contract:
- ``load_secret`` reads the secret from a file (first) or an environment
  variable; it strips surrounding whitespace and refuses a missing, empty or
  short secret with an error that says how to make one. It never returns an
  empty secret, so an unconfigured router cannot accept everyone.
- ``bearer_header`` is the ``Authorization`` header a worker sends.
- ``check_authorization`` compares in constant time (``hmac.compare_digest``)
  and returns ``None`` when the header carries exactly the secret, otherwise a
  refusal naming what was wrong (missing header, not a bearer token, wrong
  secret). The refusal never echoes the presented value.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path

SECRET_ENV_VAR = "KVRELAY_SECRET"
SECRET_FILE_ENV_VAR = "KVRELAY_SECRET_FILE"
MIN_SECRET_BYTES = 16
_HOW_TO_MAKE_ONE = "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"


class SecretError(ValueError):
    """The shared secret is not configured, or is unusable."""


def load_secret(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> bytes:
    """The shared secret from ``path``, else ``$KVRELAY_SECRET_FILE``, else ``$KVRELAY_SECRET``."""
    env = os.environ if environ is None else environ
    if path is None and env.get(SECRET_FILE_ENV_VAR):
        path = env[SECRET_FILE_ENV_VAR]
    if path is not None:
        source = f"secret file {str(path)!r}"
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise SecretError(f"cannot read the {source}: {exc.strerror}; {_HOW_TO_MAKE_ONE} > FILE") from None
    elif env.get(SECRET_ENV_VAR):
        source = f"${SECRET_ENV_VAR}"
        secret = env[SECRET_ENV_VAR].strip().encode()
    else:
        raise SecretError(
            f"no shared secret configured: pass a secret file or set ${SECRET_FILE_ENV_VAR} "
            f"or ${SECRET_ENV_VAR}; {_HOW_TO_MAKE_ONE}"
        )
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(
            f"the {source} holds {len(secret)} bytes; use at least {MIN_SECRET_BYTES}; {_HOW_TO_MAKE_ONE}"
        )
    if b"\n" in secret or b"\r" in secret:
        raise SecretError(f"the {source} spans several lines; it must be one line")
    return secret


def bearer_header(secret: bytes) -> tuple[str, str]:
    """The handshake header that presents ``secret``."""
    return ("Authorization", "Bearer " + secret.decode("latin-1"))


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a handshake was refused and the HTTP status to answer with."""

    status: HTTPStatus
    reason: str


def check_authorization(header: str | None, secret: bytes) -> Refusal | None:
    """``None`` when ``header`` is ``Bearer <secret>``; otherwise the refusal."""
    if not header:
        return Refusal(HTTPStatus.UNAUTHORIZED, "missing Authorization header (expected 'Bearer <secret>')")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return Refusal(HTTPStatus.UNAUTHORIZED, "Authorization header is not a bearer token")
    presented = token.strip().encode("latin-1", errors="replace")
    if not hmac.compare_digest(presented, secret):
        return Refusal(HTTPStatus.FORBIDDEN, "wrong shared secret")
    return None
