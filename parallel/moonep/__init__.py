"""MoonEP: static-shape, perfectly balanced expert parallelism with no host sync (SPEC 10)."""
