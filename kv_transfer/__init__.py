"""KV block transfer between nodes: wire format (wire.py), receiver checks (validate.py),
the transport interface and fallback (transport.py), transports (shm_transport.py,
tcp_transport.py, grpc_transport.py), the decode node's data port that receives shm and tcp
transfers (receiver.py, framing in data_port.py). Pool layout: kv_transfer/layout.py."""
