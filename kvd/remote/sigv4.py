"""AWS Signature Version 4 for S3 requests signed in the Authorization header.

Only what kvd's calls need: the canonical request of one method, path, query and header set,
the key derived per day, region and service, and the headers that carry the signature. The
payload hash is the caller's: the hex sha256 of the body, or UNSIGNED_PAYLOAD.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Final
from urllib.parse import quote

from kvd.remote.credentials import Credentials

ALGORITHM: Final = "AWS4-HMAC-SHA256"
SERVICE: Final = "s3"
UNSIGNED_PAYLOAD: Final = "UNSIGNED-PAYLOAD"
EMPTY_SHA256: Final = hashlib.sha256(b"").hexdigest()


def uri_path(path: str) -> str:
    """A path as S3 signs and sends it: every byte but unreserved characters and "/" escaped."""
    return quote(path, safe="/-_.~")


def canonical_query(query: Mapping[str, str]) -> str:
    """The query string in the order and escaping the signature covers (also what is sent)."""
    return "&".join(
        f"{quote(name, safe='-_.~')}={quote(value, safe='-_.~')}"
        for name, value in sorted(query.items())
    )


def signing_key(secret_key: str, day: str, region: str) -> bytes:
    key = hmac.digest(f"AWS4{secret_key}".encode(), day.encode(), "sha256")
    for part in (region, SERVICE, "aws4_request"):
        key = hmac.digest(key, part.encode(), "sha256")
    return key


class Signer:
    """Signs requests for one set of credentials and region; the day's key is kept (one HMAC
    chain a day rather than four HMACs a request)."""

    def __init__(self, credentials: Credentials, region: str) -> None:
        self.credentials = credentials
        self.region = region
        self._day_key = ("", b"")  # one tuple, so threads never see one day's key under another

    def __repr__(self) -> str:
        return f"Signer({self.credentials!r}, region={self.region!r})"

    def headers(
        self,
        method: str,
        host: str,
        path: str,
        *,
        query: Mapping[str, str],
        headers: Mapping[str, str],
        payload_hash: str,
        now: datetime | None = None,
    ) -> dict[str, str]:
        """`headers` plus host, x-amz-date, x-amz-content-sha256, the session token if any,
        and Authorization; every header given is signed. `path` is already escaped
        (uri_path)."""
        moment = now or datetime.now(UTC)
        stamp = moment.strftime("%Y%m%dT%H%M%SZ")
        day = stamp[:8]
        signed = {name.lower(): str(value).strip() for name, value in headers.items()}
        signed["host"] = host
        signed["x-amz-date"] = stamp
        signed["x-amz-content-sha256"] = payload_hash
        if self.credentials.session_token:
            signed["x-amz-security-token"] = self.credentials.session_token
        names = sorted(signed)
        canonical = "\n".join(
            [
                method,
                path,
                canonical_query(query),
                *(f"{name}:{signed[name]}" for name in names),
                "",
                ";".join(names),
                payload_hash,
            ]
        )
        scope = f"{day}/{self.region}/{SERVICE}/aws4_request"
        to_sign = "\n".join(
            [ALGORITHM, stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        key_day, key = self._day_key
        if key_day != day:
            key = signing_key(self.credentials.secret_key, day, self.region)
            self._day_key = (day, key)
        signature = hmac.digest(key, to_sign.encode(), "sha256").hex()
        signed["authorization"] = (
            f"{ALGORITHM} Credential={self.credentials.access_key}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        )
        return signed
