"""Prefill->decode KV transfer: handshake, wire format, transports and the sender-side cast."""
