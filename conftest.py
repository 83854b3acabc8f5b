"""Root conftest: the plugin itself is registered by its pytest11 entry point (pip install -e .)."""
