from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SGLITE_SKIP_REAL_MODEL") == "1":
        skip = pytest.mark.skip(reason="SGLITE_SKIP_REAL_MODEL=1")
        for item in items:
            if "real_model" in item.keywords:
                item.add_marker(skip)
