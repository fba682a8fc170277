"""SigV4 against the worked examples of AWS's S3 documentation ("Signature Calculations for
the Authorization Header: Transferring Payload in a Single Chunk"): the same credentials,
time and request give the signatures printed there. The bucket tests check the signing
against a real server; these check it against AWS's own rules (which a server could accept
more loosely)."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import NamedTuple

import pytest

from kvd.remote.credentials import Credentials
from kvd.remote.sigv4 import EMPTY_SHA256, Signer, uri_path

EXAMPLE = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
HOST = "examplebucket.s3.amazonaws.com"
WHEN = datetime(2013, 5, 24, tzinfo=UTC)


class Example(NamedTuple):
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    payload: str
    signed: str  # the SignedHeaders list
    signature: str


EXAMPLES = {
    "get object": Example(
        "GET",
        "/test.txt",
        {},
        {"Range": "bytes=0-9"},
        EMPTY_SHA256,
        "host;range;x-amz-content-sha256;x-amz-date",
        "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41",
    ),
    "put object": Example(
        "PUT",
        uri_path("/test$file.text"),
        {},
        {"Date": "Fri, 24 May 2013 00:00:00 GMT", "x-amz-storage-class": "REDUCED_REDUNDANCY"},
        hashlib.sha256(b"Welcome to Amazon S3.").hexdigest(),
        "date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class",
        "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd",
    ),
    "list objects": Example(
        "GET",
        "/",
        {"max-keys": "2", "prefix": "J"},
        {},
        EMPTY_SHA256,
        "host;x-amz-content-sha256;x-amz-date",
        "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7",
    ),
}


@pytest.mark.parametrize("example", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_the_signatures_of_aws_worked_examples(example: Example) -> None:
    result = Signer(EXAMPLE, "us-east-1").headers(
        example.method,
        HOST,
        example.path,
        query=example.query,
        headers=example.headers,
        payload_hash=example.payload,
        now=WHEN,
    )
    assert result["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        f"SignedHeaders={example.signed}, Signature={example.signature}"
    )
    assert result["x-amz-date"] == "20130524T000000Z"
    assert result["x-amz-content-sha256"] == example.payload


def test_a_session_token_is_sent_and_signed() -> None:
    credentials = Credentials("AKID", "secret", session_token="token")
    result = Signer(credentials, "eu-west-1").headers(
        "GET", HOST, "/k", query={}, headers={}, payload_hash=EMPTY_SHA256, now=WHEN
    )
    assert result["x-amz-security-token"] == "token"
    assert "x-amz-security-token" in result["authorization"].split("SignedHeaders=")[1]
    assert "/eu-west-1/s3/aws4_request" in result["authorization"]
