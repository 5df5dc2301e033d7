"""The test suite, a package: its helpers (fakes, stand-ins, servers) import like code."""
