"""KV block transfer between nodes: wire format (wire.py), receiver checks (validate.py),
transports (grpc_transport.py). Pool layout: kv_transfer/layout.py."""
