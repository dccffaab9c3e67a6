"""Root conftest: service fixtures (real Redis, later Ray) shared by every test module."""
pytest_plugins = ["tests.services"]
