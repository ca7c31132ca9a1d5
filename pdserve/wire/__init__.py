"""What crosses a socket: the message protocol, the ZeroMQ transport, the KV transfer backends."""
