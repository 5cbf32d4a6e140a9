"""The core Kubernetes objects of deploy/kuberay, and every pod template inside the
KubeRay resources, validated offline with kubernetes-validate for Kubernetes
``K8S_VERSION`` in strict mode (an unknown field fails, as ``kubectl apply`` refuses it).
docs/deploy.md, "What each file is"."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from tests.deploy.manifests import K8S_VERSION, KUBERAY, VARIANTS, documents, one, pod_templates

CORE_FILES = [f"configmap-{v}.yaml" for v in VARIANTS] + ["router.yaml"]
CUSTOM_FILES = [f"raycluster-{v}.yaml" for v in VARIANTS] + ["rayjob.yaml"]
COVERS = tuple(f"kuberay/{name}" for name in CORE_FILES + CUSTOM_FILES)


def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", CORE_FILES)
def test_core_objects_are_valid(name):
    docs = documents(KUBERAY / name)
    assert docs, f"{name} holds no object"
    for doc in docs:
        assert doc["apiVersion"] in ("v1", "apps/v1"), f"{name}: {doc['kind']} is not core"
        validate(doc)


@pytest.mark.parametrize("name", CUSTOM_FILES)
def test_pod_templates_of_kuberay_resources_are_valid(name):
    """KubeRay embeds core pod templates; each must be one Kubernetes accepts."""
    for doc in documents(KUBERAY / name):
        templates = pod_templates(doc)
        assert templates, f"{name}: no pod template"
        for where, template in templates.items():
            wrapped = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{doc['metadata']['name']}-{where}".lower()[:63]},
                "template": template,
            }
            try:
                validate(wrapped)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name} {where}: {e.message}")


def test_a_wrong_field_fails():
    """The check can fail: a port given as a list, and a misspelt probe field."""
    service = copy.deepcopy(one(KUBERAY / "router.yaml", "Service"))
    service["spec"]["ports"][0]["port"] = ["50051"]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(service)
    deployment = copy.deepcopy(one(KUBERAY / "router.yaml", "Deployment"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["grpcc"] = container["readinessProbe"].pop("grpc")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
