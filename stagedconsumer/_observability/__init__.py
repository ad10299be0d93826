"""Observability: consume hooks and the ``ConsumerView`` they see, message trace
(codec, dispatcher, sinks, hook, query), OpenTelemetry, W3C ``traceparent`` helpers.

Imports nothing: import the module you need (the runtime imports only the hook ABCs).
"""
