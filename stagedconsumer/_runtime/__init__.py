"""The anyio shell over :mod:`stagedconsumer._core`: ``PushConsumer`` and its services.

Imports nothing: import the module you need.
"""
