"""What crosses a socket: the message protocol and the ZeroMQ transport (torch-free; imports nothing above it)."""
