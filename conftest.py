"""Root conftest: environment for every test, and the service fixtures (real Redis) as a plugin."""
import os

from deploy.forking import disable_grpc_fork_support

# Before any test touches gRPC: the cluster tests start Ray in this process (deploy/forking.py).
disable_grpc_fork_support()

# Local Ray clusters in tests: no token auth (in-process ray.init would otherwise enable it and
# write a token that later clusters reject) and no usage reporting; nothing reaches a hub.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest_plugins = ["tests.services", "tests.clusters"]
