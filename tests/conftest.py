"""Shared pytest configuration: the contract-test plugin (hypothesis profiles, `spec_config`), and the
pytest-xdist groups."""

import pytest

pytest_plugins = ["spec_schema.testing.plugin"]

ONE_WORKER = ("train", "real", "bug_zoo", "properties")
"""Folders whose session fixtures are costly (toy drafts trained, the real model loaded, the zoo's and
the property pool's models built): under `pytest -n N --dist loadgroup` (scripts/test.sh) each runs on
one worker, so that each fixture is built once, not once per worker."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.relative_to(config.rootpath).parts
        if len(parts) > 2 and parts[0] == "tests" and parts[1] in ONE_WORKER:
            item.add_marker(pytest.mark.xdist_group(parts[1]))
