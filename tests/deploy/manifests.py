"""Reading deploy/ for its tests (docs/deploy.md): the files, their YAML documents, the
pdserve configs they embed, and the pieces of a KubeRay resource other files must agree
with. Offline and without Kubernetes: plain YAML and JSON.

Each test module names the deploy/ files it checks in ``COVERS`` (paths relative to
deploy/); tests/deploy/test_coverage.py holds that every file there is covered.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERAY = DEPLOY / "kuberay"
# The Kubernetes version the core objects are validated for (kubernetes-validate's
# bundled schemas, strict: unknown fields fail).
K8S_VERSION = "1.35.0"
VARIANTS = ("cpu", "gpu")


def documents(path: Path) -> list[dict]:
    """The YAML documents of a manifest, in order."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def one(path: Path, kind: str) -> dict:
    """The only document of ``kind`` in ``path``."""
    found = [d for d in documents(path) if d.get("kind") == kind]
    assert len(found) == 1, f"{path.name}: expected one {kind}, found {len(found)}"
    return found[0]


def embedded_config(variant: str) -> dict:
    """The pdserve config a ConfigMap variant holds under ``config.yaml``, as YAML data."""
    configmap = one(KUBERAY / f"configmap-{variant}.yaml", "ConfigMap")
    return yaml.safe_load(configmap["data"]["config.yaml"])


def pod_templates(resource: dict) -> dict[str, dict]:
    """Every pod template of a RayCluster or RayJob, by where it sits."""
    spec = resource["spec"]
    if resource["kind"] == "RayJob":
        found = {}
        if "submitterPodTemplate" in spec:
            found["submitterPodTemplate"] = spec["submitterPodTemplate"]
        if "rayClusterSpec" in spec:
            for where, t in _cluster_templates(spec["rayClusterSpec"]).items():
                found[f"rayClusterSpec.{where}"] = t
        return found
    return _cluster_templates(spec)


def _cluster_templates(spec: dict) -> dict[str, dict]:
    found = {"headGroupSpec": spec["headGroupSpec"]["template"]}
    for group in spec.get("workerGroupSpecs", []):
        found[f"workerGroupSpecs[{group['groupName']}]"] = group["template"]
    return found


def start_resources(params: dict[str, str]) -> dict[str, float]:
    """The custom resources a KubeRay ``rayStartParams`` offers: its ``resources`` value,
    a JSON object written as a quoted string (KubeRay passes it to ``ray start`` as is)."""
    text = params.get("resources")
    return json.loads(json.loads(text)) if text else {}


def start_labels(params: dict[str, str]) -> dict[str, str]:
    """The node labels of a ``rayStartParams`` ``labels`` value (``k=v,k2=v2``)."""
    text = params.get("labels", "")
    return dict(item.split("=", 1) for item in text.split(",") if item)


def command_flags(command: str) -> dict[str, str]:
    """``--flag=value`` and ``--flag value`` options of one shell command, unquoted."""
    flags, words = {}, shlex.split(command)
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        name, eq, value = word[2:].partition("=")
        if not eq and i + 1 < len(words) and not words[i + 1].startswith("-"):
            value = words[i + 1]
        flags[name] = value
    return flags


def cpu_quantity(value) -> float:
    """A Kubernetes CPU quantity (``2``, ``"2"``, ``500m``) in cores."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
