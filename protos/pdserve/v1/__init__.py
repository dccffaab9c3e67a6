"""pdserve.v1: serving.proto (client API) and kv.proto (node to node); *_pb2*.py are generated."""
