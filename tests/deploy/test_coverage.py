"""Every file in deploy/ is checked by a test of tests/deploy (each module names the
files it checks in ``COVERS``); deploy/grafana/ has its own test (test_grafana.py)."""

from __future__ import annotations

import importlib
import pkgutil

import tests.deploy
from tests.deploy.manifests import DEPLOY

OWN_TESTS = ("grafana",)  # folders of deploy/ whose tests do not use COVERS


def test_every_deploy_file_is_used_by_a_test():
    covered = set()
    for module in pkgutil.iter_modules(tests.deploy.__path__):
        if module.name.startswith("test_"):
            test_module = importlib.import_module(f"tests.deploy.{module.name}")
            covered |= set(getattr(test_module, "COVERS", ()))
    files = {
        str(p.relative_to(DEPLOY))
        for p in DEPLOY.rglob("*")
        if p.is_file() and p.relative_to(DEPLOY).parts[0] not in OWN_TESTS
    }
    assert files, "deploy/ is empty"
    assert covered - files == set(), "COVERS names files that do not exist"
    assert files - covered == set(), "files in deploy/ no test checks"
