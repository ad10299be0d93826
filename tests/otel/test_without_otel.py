"""The core package imports and runs (message trace included) without OpenTelemetry."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("opentelemetry", "prometheus_client"):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())

    import anyio
    from stagedconsumer import (
        MemoryBroker,
        MessageListenerStagedConcurrently,
        Producer,
        PushConsumer,
        SendMessageTraceHook,
    )
    from stagedconsumer._observability._trace_hook import ConsumeMessageTraceHook
    from stagedconsumer._observability._trace_query import trace_messages_of

    class L(MessageListenerStagedConcurrently):
        def get_stage_definitions(self):
            return [1, 2]

        async def consume_message(self, msgs, context):
            return None

    async def main():
        broker = MemoryBroker()
        broker.create_topic("t", 1)
        sent = [broker.send("t", b"x", properties={"a": "b"}) for _ in range(5)]
        assert all("traceparent" not in m.properties for m in sent)
        producer = Producer(broker)
        producer.register_send_message_hook(SendMessageTraceHook())
        async with producer:
            result = await producer.send("t", b"y", properties={"a": "b"})
        assert dict(result.message.properties) == {"a": "b"}
        consumer = PushConsumer("g", broker, L())
        consumer.subscribe("t")
        consumer.register_consume_message_hook(ConsumeMessageTraceHook())
        async with consumer:
            await consumer.wait_caught_up(timeout=10)
        assert consumer.statistics().consumed_ok == 6
        assert len(list(trace_messages_of(broker))) >= 1

    anyio.run(main)
    assert not any(name.startswith("opentelemetry") for name in sys.modules)
    try:
        import stagedconsumer.otel  # noqa: F401
    except ImportError:
        print("OK")
    """
)


def test_core_runs_without_opentelemetry() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK"


BLOCKED_IMPORT = textwrap.dedent(
    """
    import sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "opentelemetry":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    import stagedconsumer.otel
    """
)


def test_importing_the_otel_module_without_the_extra_says_what_to_install() -> None:
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED_IMPORT],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    # One exception, whose one line names the extra (no chained ModuleNotFoundError).
    assert "During handling" not in result.stderr
    assert "ModuleNotFoundError" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: stagedconsumer.otel needs OpenTelemetry, which is not installed:"
        " pip install 'stagedconsumer[otel]'"
    )


BLOCKED_EXPORTER = textwrap.dedent(
    """
    import sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "prometheus_client":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    from stagedconsumer.otel import serve_prometheus

    try:
        serve_prometheus(0, "127.0.0.1")
    except ImportError as exc:
        print(exc)
    """
)


def test_serve_prometheus_without_the_exporter_says_what_to_install() -> None:
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED_EXPORTER],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "serve_prometheus needs prometheus_client, which is not installed:"
        " pip install 'stagedconsumer[otel]'"
    )
