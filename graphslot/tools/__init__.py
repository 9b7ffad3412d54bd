"""Per-model diagnostics over the public runner and graph API: verify, poison, audit."""
