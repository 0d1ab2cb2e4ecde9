"""TLS on every channel (runtime/transport.py), with certificates made here: the whole stack
under mutual TLS answers as the plaintext one does; every server refuses a client without a
certificate its CA signed, and a plaintext one; TLS without client auth takes a client that only
verifies the server; a replica resolved from a name is held to a certificate for that name."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coordinator.launch import ROOT, LocalStack
from coordinator.peers import GrpcTarget
from coordinator.pool import Pool
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from runtime.transport import channel_credentials, open_channel

SERVING = health_pb2.HealthCheckResponse.SERVING
REQUEST = pb.GenerateRequest(prompt="def fibonacci(n):", max_new_tokens=16, temperature=0.0)
ADDRESSES = ["addr", "draft_addr", "target_addr"]  # coordinator, draft, target

Issued = tuple[ec.EllipticCurvePrivateKey, x509.Certificate]


def issue(subject: str, issuer: Issued | None = None, names: list[str] = (), ips: list[str] = ()) -> Issued:
    """A P-256 key and its certificate: a CA's (self-signed) without `issuer`; else one `issuer`
    signs, for server and client use, naming `names` and `ips` (SubjectAltName)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).public_key(key.public_key())
               .issuer_name(name if issuer is None else issuer[1].subject)
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True))
    if issuer is None:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        return key, builder.sign(key, hashes.SHA256())
    builder = builder.add_extension(
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    if names or ips:
        alternatives = [x509.DNSName(n) for n in names] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
    return key, builder.sign(issuer[0], hashes.SHA256())


def write(directory: Path, cert_file: str, key_file: str, issued: Issued) -> None:
    key, cert = issued
    (directory / cert_file).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / key_file).write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """ca.pem, cert.pem / key.pem (every process's, for localhost and 127.0.0.1), client.pem /
    client.key (a client's, the same CA), rogue.pem / rogue.key (a client's from rogue-ca.pem),
    localhost.pem / localhost.key (names localhost only, not 127.0.0.1)."""
    out = tmp_path_factory.mktemp("pki")
    ca, rogue_ca = issue("specdec test CA"), issue("rogue CA")
    write(out, "ca.pem", "ca.key", ca)
    write(out, "rogue-ca.pem", "rogue-ca.key", rogue_ca)
    write(out, "cert.pem", "key.pem", issue("specdec", ca, ["localhost"], ["127.0.0.1"]))
    write(out, "client.pem", "client.key", issue("a client", ca))
    write(out, "rogue.pem", "rogue.key", issue("a client", rogue_ca))
    write(out, "localhost.pem", "localhost.key", issue("localhost only", ca, ["localhost"]))
    return out


@pytest.fixture(scope="module")
def mtls_stack(pair, pki, request):
    stack = LocalStack(*pair, tls_dir=pki).start()
    request.addfinalizer(stack.stop)
    return stack


@pytest.fixture(scope="module")
def tls_stack(pair, pki, request):
    """TLS, no client certificates asked for."""
    stack = LocalStack(*pair, tls_dir=pki, client_auth=False).start()
    request.addfinalizer(stack.stop)
    return stack


def credentials(pki: Path, ca: str | None, cert: str | None = None) -> grpc.ChannelCredentials | None:
    if ca is None:
        return None
    key = cert and cert.replace(".pem", ".key")
    return channel_credentials(str(pki / ca), cert and str(pki / cert), key and str(pki / key))


def health_check(address: str, creds: grpc.ChannelCredentials | None) -> int:
    with open_channel(address, creds) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def generate(address: str, creds: grpc.ChannelCredentials | None) -> pb.GenerateResponse:
    with open_channel(address, creds) as channel:
        return pb_grpc.GenerationStub(channel).Generate(REQUEST, timeout=120)


def test_the_stack_under_mutual_tls_answers_as_the_plaintext_one(mtls_stack, pki, client):
    expected = client.Generate(REQUEST, timeout=120)
    got = generate(mtls_stack.addr, credentials(pki, "ca.pem", "client.pem"))
    assert len(got.token_ids) > 0 and got.stats.rounds > 0
    assert (list(got.token_ids), got.text) == (list(expected.token_ids), expected.text)


@pytest.mark.parametrize("which", ADDRESSES)
def test_mutual_tls_takes_a_certificate_the_ca_signed(mtls_stack, pki, which):
    assert health_check(getattr(mtls_stack, which), credentials(pki, "ca.pem", "client.pem")) == SERVING


@pytest.mark.parametrize("client_side", [
    pytest.param(("ca.pem", None), id="no client certificate"),
    pytest.param(("ca.pem", "rogue.pem"), id="client certificate from another CA"),
    pytest.param((None, None), id="plaintext"),
    pytest.param(("rogue-ca.pem", "client.pem"), id="client that does not trust the server's CA"),
])
@pytest.mark.parametrize("which", ADDRESSES)
def test_mutual_tls_refuses(mtls_stack, pki, which, client_side):
    with pytest.raises(grpc.RpcError) as err:
        health_check(getattr(mtls_stack, which), credentials(pki, *client_side))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()


def test_tls_without_client_auth_takes_a_client_that_only_verifies_the_server(tls_stack, pki, client):
    got = generate(tls_stack.addr, credentials(pki, "ca.pem"))
    assert list(got.token_ids) == list(client.Generate(REQUEST, timeout=120).token_ids)
    for which in ADDRESSES:
        assert health_check(getattr(tls_stack, which), credentials(pki, "ca.pem")) == SERVING
        with pytest.raises(grpc.RpcError) as err:
            health_check(getattr(tls_stack, which), None)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_replica_resolved_from_a_name_must_present_a_certificate_for_that_name(pki):
    """A server whose certificate names localhost but not 127.0.0.1: reached as localhost:PORT
    (the pool dials 127.0.0.1, checking the name) it is trusted; as 127.0.0.1:PORT it is not."""
    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [((pki / "localhost.key").read_bytes(), (pki / "localhost.pem").read_bytes())]))
    server.start()
    creds = credentials(pki, "ca.pem")

    async def check(entry: str) -> dict[str, tuple[str | None, bool]]:
        found = await Pool("target", entry, GrpcTarget).resolve()
        out = {}
        for address, server_name in found.items():
            peer = GrpcTarget(address, credentials=creds, server_name=server_name)
            try:
                await health_pb2_grpc.HealthStub(peer.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                out[address] = (server_name, True)
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                out[address] = (server_name, False)
            await peer.close()
        return out

    try:
        assert asyncio.run(check(f"localhost:{port}")) == {f"127.0.0.1:{port}": ("localhost", True)}
        assert asyncio.run(check(f"127.0.0.1:{port}")) == {f"127.0.0.1:{port}": (None, False)}
    finally:
        server.stop(0)


def test_a_pool_says_why_a_replica_fails_its_tls_handshake(pki):
    """Peer TLS set up wrong (a CA that did not sign the service's certificate; TLS to a plaintext port):
    the start-up error and the replica's detail (and the log) say the handshake failed, not only that no
    replica serves."""
    secure = grpc.server(ThreadPoolExecutor(2))
    plain = grpc.server(ThreadPoolExecutor(2))
    for server in (secure, plain):
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    secure_port = secure.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [((pki / "key.pem").read_bytes(), (pki / "cert.pem").read_bytes())]))
    plain_port = plain.add_insecure_port("127.0.0.1:0")
    for server in (secure, plain):
        server.start()

    async def start(port: int, ca: str) -> tuple[str, str]:
        creds = credentials(pki, ca)
        pool = Pool("target", f"127.0.0.1:{port}", lambda address, name: GrpcTarget(address, credentials=creds,
                                                                                  server_name=name))
        try:
            with pytest.raises(Exception) as failed:
                await pool.start(timeout=3.0)
            return str(failed.value), pool.describe()[0].detail
        finally:
            await pool.close(0)

    try:
        for port, ca in ((secure_port, "rogue-ca.pem"), (plain_port, "ca.pem")):
            error, detail = asyncio.run(start(port, ca))
            assert "no replica SERVING" in error and "handshake" in error.lower(), error
            assert "handshake" in detail.lower(), detail
    finally:
        for server in (secure, plain):
            server.stop(0)


def test_client_cli_over_mutual_tls(mtls_stack, pki, client):
    def cli(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "coordinator.client", "--addr", mtls_stack.addr, "--json",
                               "--temperature", "0", "--max-new-tokens", "16", *flags, REQUEST.prompt],
                              cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)

    ca, cert, key = (str(pki / name) for name in ("ca.pem", "client.pem", "client.key"))
    out = cli("--tls-ca", ca, "--tls-cert", cert, "--tls-key", key)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["token_ids"] == list(client.Generate(REQUEST, timeout=120).token_ids)
    refused = cli("--tls-ca", ca)  # no client certificate
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr, refused.stderr
