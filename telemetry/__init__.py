"""What an operator sees: Prometheus metrics (``metrics.py``) and OpenTelemetry traces
(``tracing.py``), shared by the router and the nodes. Torch-free and Ray-free; the Ray
dashboard's gauges are exported by the node actor itself (``node/actor.py``)."""
