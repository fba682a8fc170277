"""A private CA and a server certificate for 127.0.0.1, made with the openssl command (Debian's
`openssl` package; .ci/run installs it), for the tests of a TLS endpoint."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

_SERVER_EXTENSIONS = """\
subjectAltName = IP:127.0.0.1
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
"""


@dataclass(frozen=True)
class Certificates:
    ca: Path  # what a client trusts (AWS_CA_BUNDLE)
    certificate: Path  # the server's, signed by the CA
    key: Path  # the server's private key


def make_certificates(folder: Path) -> Certificates:
    """A CA and a server certificate signed by it, valid for two days; skips the test where
    no openssl command exists."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command to make a test certificate (Debian: openssl)")
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = folder / "ca.pem", folder / "ca.key"
    certificate, key, request = folder / "server.pem", folder / "server.key", folder / "server.csr"
    extensions = folder / "server.ext"
    extensions.write_text(_SERVER_EXTENSIONS)
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    commands = [
        [openssl, "req", "-x509", *curve, "-keyout", ca_key, "-out", ca, "-days", "2",
         "-subj", "/CN=kvd test CA",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        [openssl, "req", *curve, "-keyout", key, "-out", request, "-subj", "/CN=127.0.0.1"],
        [openssl, "x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key,
         "-CAcreateserial", "-out", certificate, "-days", "2", "-extfile", extensions],
    ]  # fmt: skip
    for command in commands:
        subprocess.run([str(part) for part in command], check=True, capture_output=True)
    return Certificates(ca, certificate, key)
