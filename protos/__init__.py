"""Protobuf sources and the Python generated from them (`python -m protos.generate`)."""
