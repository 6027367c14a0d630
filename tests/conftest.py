"""Shared pytest configuration: the contract-test plugin (hypothesis profiles, `spec_config`)."""

pytest_plugins = ["spec_schema.testing.plugin"]
