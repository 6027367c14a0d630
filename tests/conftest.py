"""Shared pytest configuration: the contract-test plugin (hypothesis profiles, `spec_config`)."""

import os

pytest_plugins = ["spec_schema.testing.plugin"]

# FastOptions.tuning_cache off: a test's setup decisions are its own timings or files, never an earlier
# run's on the machine (tests/runtime/test_fast_path.py turns the cache on where it tests it)
os.environ["SPEC_TUNING_CACHE"] = "0"
