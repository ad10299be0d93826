"""Message sources: the ``MessageSource`` ABC, group coordination and queue
allocation, the embedded ``MemoryBroker`` and the Redis Streams broker.

Imports nothing: import the module you need (the runtime imports only the ABCs).
"""
