"""TLS to a redis-server of the test's own on 127.0.0.1 (certificates made at test
time with trustme): server-only and mutual TLS work, a server certificate from
another CA or for another host name is refused at once with the TLS reason, the
same on asyncio (redis-py) and trio (coredis)."""

from __future__ import annotations

import logging
import shutil
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
import trustme

from benchmarks._ports import free_ports
from stagedconsumer import ConfigurationError, MessageQueue, RedisTLS, SourceError
from stagedconsumer._cli import main
from stagedconsumer._sources._redis_broker import RedisBroker
from tests.conftest import require_service
from tests.redis._server import RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


class TLSServer:
    """A redis-server with a TLS port (``url``) beside its plain one."""

    def __init__(self, directory: Path, cert: trustme.LeafCert, ca: trustme.CA, mutual: bool):
        directory.mkdir()
        cert.cert_chain_pems[0].write_to_path(directory / "server.pem")
        cert.private_key_pem.write_to_path(directory / "server.key")
        ca.cert_pem.write_to_path(directory / "ca.pem")
        (self.tls_port,) = free_ports(1)
        self.server = RedisServer(
            directory,
            "--tls-port", str(self.tls_port),
            "--tls-cert-file", str(directory / "server.pem"),
            "--tls-key-file", str(directory / "server.key"),
            "--tls-ca-cert-file", str(directory / "ca.pem"),
            "--tls-auth-clients", "yes" if mutual else "no",
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{self.tls_port}/0"


StartServer = Callable[..., TLSServer]
"""``start(*hosts, mutual=False)``: a TLS server whose certificate names ``hosts``."""


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def start_tls_server(tmp_path: Path, ca: trustme.CA) -> Iterator[StartServer]:
    require_service("redis-server binary", shutil.which("redis-server") is not None, "not on PATH")
    started: list[TLSServer] = []

    def start(*hosts: str, mutual: bool = False) -> TLSServer:
        server = TLSServer(tmp_path / f"s{len(started)}", ca.issue_cert(*hosts), ca, mutual)
        server.server.start()
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.server.kill()


def _files(ca: trustme.CA, directory: Path, client: bool = False) -> RedisTLS:
    ca.cert_pem.write_to_path(directory / "client-ca.pem")
    if not client:
        return RedisTLS(ca_file=directory / "client-ca.pem")
    cert = ca.issue_cert("stagedconsumer-client")
    cert.cert_chain_pems[0].write_to_path(directory / "client.pem")
    cert.private_key_pem.write_to_path(directory / "client.key")
    return RedisTLS(
        ca_file=directory / "client-ca.pem",
        cert_file=directory / "client.pem",
        key_file=directory / "client.key",
    )


async def _round_trip(broker: RedisBroker) -> None:
    await broker.create_topic("t", 1)
    await broker.send("t", b"over tls")
    pulled = await broker.pull(MessageQueue("t", 0), 0, 10)
    assert [m.body for m in pulled.messages] == [b"over tls"]


async def test_server_only_tls(
    start_tls_server: StartServer, ca: trustme.CA, tmp_path: Path
) -> None:
    server = start_tls_server("127.0.0.1")
    context = ssl.create_default_context()
    ca.configure_trust(context)
    settings: list[tuple[str, ssl.SSLContext | RedisTLS]] = [
        (server.url, _files(ca, tmp_path)),
        (server.url, context),
        (server.url.replace("redis://", "rediss://"), _files(ca, tmp_path)),
    ]
    for i, (url, setting) in enumerate(settings):
        async with RedisBroker(url, namespace=f"tls{i}", ssl=setting) as broker:
            assert broker.tls is not None
            assert broker.tls.check_hostname
            await _round_trip(broker)


async def test_mutual_tls(start_tls_server: StartServer, ca: trustme.CA, tmp_path: Path) -> None:
    server = start_tls_server("127.0.0.1", mutual=True)
    async with RedisBroker(server.url, namespace="mtls", ssl=_files(ca, tmp_path, True)) as broker:
        await _round_trip(broker)
    # without a client certificate the server refuses the connection, for good
    with pytest.raises(SourceError) as refused:
        async with RedisBroker(server.url, ssl=_files(ca, tmp_path), connect_timeout=60):
            pass
    assert not refused.value.retriable
    assert "(TLS: " in str(refused.value)
    assert "CERTIFICATE_REQUIRED" in str(refused.value)


async def test_a_certificate_from_another_ca_is_refused_at_once(
    start_tls_server: StartServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="stagedconsumer.redis")
    server = start_tls_server("127.0.0.1")
    with pytest.raises(SourceError) as refused:
        async with RedisBroker(server.url, ssl=_files(trustme.CA(), tmp_path), connect_timeout=60):
            pass
    assert not refused.value.retriable
    assert "TLS: certificate verify failed" in str(refused.value)
    assert "not reachable yet" not in caplog.text  # not retried


@pytest.mark.parametrize("certified", [("localhost",), ("redis.example", "127.0.0.2")])
async def test_a_certificate_for_another_host_is_refused_at_once(
    start_tls_server: StartServer,
    ca: trustme.CA,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    certified: tuple[str, ...],
) -> None:
    """The URL's host is 127.0.0.1; the certificate names others (a name, another
    address): refused on both clients, unless the host name check is turned off."""
    caplog.set_level(logging.WARNING, logger="stagedconsumer.redis")
    server = start_tls_server(*certified)
    with pytest.raises(SourceError) as refused:
        async with RedisBroker(server.url, ssl=_files(ca, tmp_path), connect_timeout=60):
            pass
    assert not refused.value.retriable
    assert "TLS: " in str(refused.value)
    assert "mismatch" in str(refused.value)
    assert "not reachable yet" not in caplog.text
    unchecked = RedisTLS(ca_file=_files(ca, tmp_path).ca_file, check_hostname=False)
    async with RedisBroker(server.url, namespace="tls", ssl=unchecked) as broker:
        await _round_trip(broker)


def test_tls_settings_are_checked_when_the_broker_is_made(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="RedisTLS: cannot load"):
        RedisBroker("redis://127.0.0.1:1/0", ssl=RedisTLS(ca_file=tmp_path / "missing.pem"))
    with pytest.raises(ConfigurationError, match="key_file needs cert_file"):
        RedisTLS(key_file="k.pem")
    with pytest.raises(ConfigurationError, match="ssl_ca_certs"):
        RedisBroker("rediss://127.0.0.1:1/0?ssl_ca_certs=/ca.pem")
    with pytest.raises(ConfigurationError, match="contradicts"):
        RedisBroker("rediss://127.0.0.1:1/0", ssl=False)
    with pytest.raises(ConfigurationError, match="ssl must be"):
        RedisBroker("redis://127.0.0.1:1/0", ssl="yes")  # type: ignore[arg-type]
    assert RedisBroker("redis://127.0.0.1:1/0").tls is None
    default = RedisBroker("rediss://127.0.0.1:1/0").tls
    assert default is not None
    assert default.check_hostname
    assert default.verify_mode == ssl.CERT_REQUIRED


@pytest.fixture
def tls_cluster(tmp_path: Path, ca: trustme.CA) -> Iterator[str]:
    """A Redis Cluster of three masters on 127.0.0.1 that speaks only TLS (its bus
    too); the URL of one node."""
    require_service("redis-server binary", shutil.which("redis-server") is not None, "not on PATH")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "server.pem")
    cert.private_key_pem.write_to_path(tmp_path / "server.key")
    ports = free_ports(6)
    tls = ["--tls", "--cacert", str(tmp_path / "ca.pem")]
    procs = []
    try:
        for port, bus in zip(ports[:3], ports[3:], strict=True):
            node = tmp_path / f"node{port}"
            node.mkdir()
            procs.append(
                subprocess.Popen(
                    [
                        "redis-server", "--port", "0", "--tls-port", str(port),
                        "--bind", "127.0.0.1", "--dir", str(node),
                        "--cluster-enabled", "yes", "--cluster-port", str(bus),
                        "--cluster-config-file", str(node / "nodes.conf"),
                        "--tls-cluster", "yes", "--tls-auth-clients", "no",
                        "--tls-cert-file", str(tmp_path / "server.pem"),
                        "--tls-key-file", str(tmp_path / "server.key"),
                        "--tls-ca-cert-file", str(tmp_path / "ca.pem"),
                        "--save", "", "--appendonly", "no",
                        "--logfile", str(node / "redis.log"),
                    ]
                )
            )  # fmt: skip
        for port in ports[:3]:
            deadline = time.monotonic() + 10
            while (
                b"PONG"
                not in subprocess.run(
                    ["redis-cli", *tls, "-p", str(port), "ping"], capture_output=True, check=False
                ).stdout
            ):
                assert time.monotonic() < deadline, f"TLS node {port} did not start"
                time.sleep(0.05)
        subprocess.run(
            ["redis-cli", *tls, "--cluster", "create",
             *(f"127.0.0.1:{port}" for port in ports[:3]), "--cluster-yes"],
            capture_output=True, check=True, timeout=60,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not all(
            b"cluster_state:ok"
            in subprocess.run(
                ["redis-cli", *tls, "-p", str(port), "cluster", "info"],
                capture_output=True,
                check=False,
            ).stdout
            for port in ports[:3]
        ):
            assert time.monotonic() < deadline, "TLS cluster not ok"
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{ports[0]}"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.slow
async def test_tls_on_a_cluster(tls_cluster: str, ca: trustme.CA, tmp_path: Path) -> None:
    """The cluster clients get the same context (every node is reached with it)."""
    async with RedisBroker(
        tls_cluster, cluster=True, namespace="tls", ssl=_files(ca, tmp_path)
    ) as broker:
        await broker.create_topic("t", 4)
        for queue in range(4):  # the queues' slots spread over the three masters
            await broker.send("t", b"x", queue_id=queue)
        for queue in range(4):
            assert len((await broker.pull(MessageQueue("t", queue), 0, 10)).messages) == 1
        await broker.delete_namespace()
    with pytest.raises(SourceError) as refused:
        async with RedisBroker(tls_cluster, cluster=True, ssl=_files(trustme.CA(), tmp_path)):
            pass
    assert not refused.value.retriable
    assert "TLS: certificate verify failed" in str(refused.value)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the CLI runs on asyncio
async def test_the_operator_commands_take_tls_files(
    start_tls_server: StartServer,
    ca: trustme.CA,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = start_tls_server("127.0.0.1", mutual=True)
    files = _files(ca, tmp_path, client=True)
    async with RedisBroker(server.url, namespace="ops", ssl=files) as broker:
        await broker.create_topic("t", 2)
    show = ["group", "show", "--group", "g", "--topic", "t", "--redis", server.url,
            "--namespace", "ops"]  # fmt: skip
    tls = ["--redis-ca", str(files.ca_file), "--redis-cert", str(files.cert_file),
           "--redis-key", str(files.key_file)]  # fmt: skip
    assert await anyio.to_thread.run_sync(main, [*show, *tls]) == 0
    assert "group g: 0 live member(s)" in capsys.readouterr().out
    # the server's CA but no client certificate: refused, with the TLS reason
    assert await anyio.to_thread.run_sync(main, [*show, *tls[:2]]) == 1
    err = capsys.readouterr().err
    # TLS 1.3 asks for the client's certificate after the client finished its side of
    # the handshake: the server's alert (the TLS reason) usually arrives, but the
    # server may close first, and the client then sees a reset connection
    assert "(TLS: " in err or "Connection reset by peer" in err, err
    assert "cannot connect to Redis" in err
