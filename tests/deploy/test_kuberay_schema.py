"""The KubeRay resources of deploy/kuberay against deploy/schema/kuberay-v1.3.json, the
project's JSON schema of the RayCluster and RayJob fields they use (types and required
keys as KubeRay v1.3's ray.io/v1 CRDs define them; docs/deploy.md), with jsonschema."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from tests.deploy.manifests import DEPLOY, KUBERAY, VARIANTS, documents, one

SCHEMA_FILE = DEPLOY / "schema" / "kuberay-v1.3.json"
FILES = [f"raycluster-{v}.yaml" for v in VARIANTS] + ["rayjob.yaml"]
COVERS = ("schema/kuberay-v1.3.json", *(f"kuberay/{f}" for f in FILES))


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def problems(validator, doc: dict) -> list[str]:
    errors = validator.iter_errors(doc)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


@pytest.mark.parametrize("name", FILES)
def test_kuberay_resources_match_the_schema(validator, name):
    docs = documents(KUBERAY / name)
    assert [d["kind"] for d in docs] in (["RayCluster"], ["RayJob"])
    for doc in docs:
        assert problems(validator, doc) == []


def cluster() -> dict:
    return copy.deepcopy(one(KUBERAY / "raycluster-cpu.yaml", "RayCluster"))


def job() -> dict:
    return copy.deepcopy(one(KUBERAY / "rayjob.yaml", "RayJob"))


def _drop_group_name(c):
    del c["spec"]["workerGroupSpecs"][0]["groupName"]


def _replicas_as_text(c):
    c["spec"]["workerGroupSpecs"][0]["replicas"] = "2"


def _start_param_as_number(c):
    c["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0


def _misspelt_field(c):
    c["spec"]["workerGroupSpec"] = c["spec"].pop("workerGroupSpecs")


def _drop_head(c):
    del c["spec"]["headGroupSpec"]


def _drop_template(c):
    del c["spec"]["headGroupSpec"]["template"]


def _resources_as_mapping(j):
    j["spec"]["entrypointResources"] = {"pdserve_router": 1}


def _cpus_as_text(j):
    j["spec"]["entrypointNumCpus"] = "1"


def _selector_value_as_number(j):
    j["spec"]["clusterSelector"]["ray.io/cluster"] = 1


def _wrong_api_version(j):
    j["apiVersion"] = "ray.io/v1alpha1"


@pytest.mark.parametrize(
    "make, change",
    [
        (cluster, _drop_group_name),
        (cluster, _replicas_as_text),
        (cluster, _start_param_as_number),
        (cluster, _misspelt_field),
        (cluster, _drop_head),
        (cluster, _drop_template),
        (job, _resources_as_mapping),
        (job, _cpus_as_text),
        (job, _selector_value_as_number),
        (job, _wrong_api_version),
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_wrong_type_or_missing_key_fails(validator, make, change):
    doc = make()
    assert problems(validator, doc) == []
    change(doc)
    assert problems(validator, doc) != []
