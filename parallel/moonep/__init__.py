"""MoonEP: static-shape, perfectly balanced expert parallelism with no host sync."""
