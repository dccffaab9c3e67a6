"""What keeps strangers off pdserve's sockets, in one torch-free, Ray-free package that the
router, the nodes and the launcher share: TLS and mutual TLS for every gRPC hop (``tls``), API
keys checked on client routes (``api_keys``), and a throwaway CA for a local cluster (``ca``).
The SDK (``pdserve/``) carries its own few lines for the client side; it imports no server code.
"""
