"""What every serving node shares, whatever its role: config (config.py), the Ray actor
(actor.py), the server base (server.py), the engine thread (engine_thread.py) and the link to
the KV index (publisher.py). The role packages, prefill_node/ and decode_node/, hold only what
differs. Import submodules directly."""
